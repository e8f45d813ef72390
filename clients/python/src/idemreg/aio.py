"""The asyncio client (grpc.aio): the registry's calls, typed, and once()."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar, Union, overload

import grpc
import grpc.aio

from idemreg import _core, errors
from idemreg._core import (
    Attempt,
    BatchAnswer,
    BatchItem,
    Claim,
    ClaimParams,
    CompleteParams,
    Fence,
    Key,
    OnceResult,
)
from idemreg.client import _attempt, _item_error
from idemreg.codec import JSON, Codec
from idemreg.credentials import Target
from idemreg.v1 import registry_pb2
from idemreg.v1.registry_pb2_grpc import RegistryServiceStub

log = logging.getLogger("idemreg")

T = TypeVar("T")


class AsyncClient:
    """:class:`idemreg.Client` for asyncio: the same arguments, every call a
    coroutine. Create it inside the event loop it is used on."""

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        channel: Optional[grpc.aio.Channel] = None,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[bytes] = None,
        private_key: Optional[bytes] = None,
        certificate_chain: Optional[bytes] = None,
        insecure_token: bool = False,
        options: Optional[list[tuple[str, Any]]] = None,
        timeout: float = _core.DEFAULT_TIMEOUT,
        holder: str = "",
    ) -> None:
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._own_channel = channel is None
        if channel is None:
            if target is None:
                raise ValueError("AsyncClient needs a target or a channel")
            t = Target(
                target,
                token=token,
                tls=tls,
                root_certificates=root_certificates,
                private_key=private_key,
                certificate_chain=certificate_chain,
                insecure_token=insecure_token,
                options=options,
            )
            self._metadata = t.metadata
            if t.credentials is not None:
                channel = grpc.aio.secure_channel(t.target, t.credentials, options=t.options)
            else:
                channel = grpc.aio.insecure_channel(t.target, options=t.options)
        self.channel = channel
        self._stub = RegistryServiceStub(channel)
        self.timeout = timeout
        self.holder = holder
        self._run_times = _core.RunTimes()
        # Releases of claims their callers gave up on, kept from the collector.
        self._background: set["asyncio.Future[None]"] = set()

    async def close(self) -> None:
        """Closes the channel, if this client opened it."""
        if self._own_channel:
            await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, method: Any, req: Any, timeout: Optional[float]) -> Any:
        try:
            return await method(req, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata or None)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    async def claim(
        self,
        key: Key,
        *,
        fingerprint: bytes = b"",
        lease: Optional[float] = None,
        retention: Optional[float] = None,
        holder: str = "",
        request_id: str = "",
        wait: Optional[float] = None,
        timeout: Optional[float] = None,
    ) -> Claim:
        """:meth:`idemreg.Client.claim`."""
        return await self._claim(ClaimParams(key, fingerprint, lease, retention, holder, request_id, wait), timeout)

    async def _claim(self, p: ClaimParams, timeout: Optional[float]) -> Claim:
        return Claim.of(await self._call(self._stub.Claim, p.request(self.holder), timeout))

    async def complete(self, key: Key, fence: Fence, result: registry_pb2.Result, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """:meth:`idemreg.Client.complete`."""
        resp: registry_pb2.CompleteResponse = await self._call(self._stub.Complete, CompleteParams(key, fence, result).request(), timeout)
        return resp.record

    async def release(self, key: Key, fence: Fence, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """:meth:`idemreg.Client.release`."""
        req = registry_pb2.ReleaseRequest(consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, claim_secret=fence.secret)
        resp: registry_pb2.ReleaseResponse = await self._call(self._stub.Release, req, timeout)
        return resp.record

    async def extend(self, key: Key, fence: Fence, *, lease: Optional[float] = None, timeout: Optional[float] = None) -> registry_pb2.Record:
        """:meth:`idemreg.Client.extend`."""
        req = registry_pb2.ExtendRequest(
            consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, lease=_core.duration(lease), claim_secret=fence.secret
        )
        resp: registry_pb2.ExtendResponse = await self._call(self._stub.Extend, req, timeout)
        return resp.record

    async def park(self, key: Key, fence: Fence, reason: str, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """:meth:`idemreg.Client.park`."""
        req = registry_pb2.ParkRequest(consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, reason=reason, claim_secret=fence.secret)
        resp: registry_pb2.ParkResponse = await self._call(self._stub.Park, req, timeout)
        return resp.record

    async def lookup(self, key: Key, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """:meth:`idemreg.Client.lookup`."""
        req = registry_pb2.LookupRequest(consumer=key.consumer, kind=key.kind, key=key.key)
        resp: registry_pb2.LookupResponse = await self._call(self._stub.Lookup, req, timeout)
        return resp.record

    async def batch_claim(self, claims: list[ClaimParams], *, timeout: Optional[float] = None) -> list[Union[Claim, errors.IdemregError]]:
        """:meth:`idemreg.Client.batch_claim`."""
        out: list[Union[Claim, errors.IdemregError]] = []
        reqs = [p.request(self.holder) for p in claims]
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            req = registry_pb2.BatchClaimRequest(requests=part)
            resp: registry_pb2.BatchClaimResponse = await self._call(self._stub.BatchClaim, req, timeout)
            for r in resp.results:
                out.append(Claim.of(r.response) if r.WhichOneof("result") == "response" else _item_error(r.error))
        return out

    async def batch_complete(
        self, completes: list[CompleteParams], *, timeout: Optional[float] = None
    ) -> list[Union[registry_pb2.Record, errors.IdemregError]]:
        """:meth:`idemreg.Client.batch_complete`."""
        out: list[Union[registry_pb2.Record, errors.IdemregError]] = []
        reqs = [p.request() for p in completes]
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            req = registry_pb2.BatchCompleteRequest(requests=part)
            resp: registry_pb2.BatchCompleteResponse = await self._call(self._stub.BatchComplete, req, timeout)
            for r in resp.results:
                out.append(r.response.record if r.WhichOneof("result") == "response" else _item_error(r.error))
        return out

    async def batch(self, items: list[BatchItem], *, timeout: Optional[float] = None) -> list[BatchAnswer]:
        """:meth:`idemreg.Client.batch`."""
        out: list[BatchAnswer] = []
        reqs = _core.batch_items(items, self.holder)
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            out.extend(_core.batch_answers(await self._call(self._stub.Batch, registry_pb2.BatchRequest(items=part), timeout)))
        return out

    @overload
    def once(
        self,
        consumer: str,
        key: str,
        fn: Callable[[Attempt], Awaitable[Any]],
        *,
        kind: int = _core.KIND_MESSAGE,
        fingerprint: bytes = b"",
        lease: float = _core.DEFAULT_LEASE,
        retention: Optional[float] = None,
        wait: Optional[float] = None,
        codec: Codec = JSON,
        result_type: str = "",
        bookkeeping_timeout: float = _core.DEFAULT_BOOKKEEPING_TIMEOUT,
    ) -> Awaitable[OnceResult]: ...

    @overload
    def once(
        self,
        consumer: str,
        key: Union[str, Callable[..., str]],
        fn: None = None,
        *,
        kind: int = _core.KIND_MESSAGE,
        fingerprint: bytes = b"",
        lease: float = _core.DEFAULT_LEASE,
        retention: Optional[float] = None,
        wait: Optional[float] = None,
        codec: Codec = JSON,
        result_type: str = "",
        bookkeeping_timeout: float = _core.DEFAULT_BOOKKEEPING_TIMEOUT,
    ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]: ...

    def once(
        self,
        consumer: str,
        key: Union[str, Callable[..., str]],
        fn: Optional[Callable[[Attempt], Awaitable[Any]]] = None,
        *,
        kind: int = _core.KIND_MESSAGE,
        fingerprint: bytes = b"",
        lease: float = _core.DEFAULT_LEASE,
        retention: Optional[float] = None,
        wait: Optional[float] = None,
        codec: Codec = JSON,
        result_type: str = "",
        bookkeeping_timeout: float = _core.DEFAULT_BOOKKEEPING_TIMEOUT,
    ) -> Any:
        """:meth:`idemreg.Client.once` for coroutines (``await c.once(...)``,
        or ``@c.once(consumer, key=...)`` on an ``async def``). Should the
        registry report the claim lost while fn runs, fn's task is cancelled
        and once raises the loss (a LeaseLostError, say)."""
        settings = _core.OnceSettings(kind, fingerprint, lease, retention, wait, codec, result_type, bookkeeping_timeout)
        if fn is not None:
            if callable(key) and not isinstance(key, str):
                raise TypeError("once: key must be the message id when fn is given")
            return self._once(consumer, key, fn, settings)

        def decorator(f: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(f)
            async def wrapper(*args: Any, **kwargs: Any) -> T:
                async def handler(a: Attempt) -> Any:
                    _attempt.set(a)  # the handler's task has a context of its own
                    return await f(*args, **kwargs)

                res = await self._once(consumer, _core.call_key(key, args, kwargs), handler, settings)
                return res.value  # type: ignore[no-any-return]

            return wrapper

        return decorator

    async def _once(
        self,
        consumer: str,
        message_id: str,
        fn: Callable[[Attempt], Awaitable[Any]],
        s: _core.OnceSettings,
    ) -> OnceResult:
        k = Key(consumer, message_id, s.kind)
        cl = await self._claim_waiting(ClaimParams(k, s.fingerprint, s.lease, s.retention), s.wait, s.bookkeeping_timeout)
        if cl.outcome == registry_pb2.OUTCOME_COMPLETED:
            return _core.replay(cl.record, s.codec)
        if cl.outcome != registry_pb2.OUTCOME_ACQUIRED:
            raise errors.InternalError(f"an unexpected claim outcome {cl.outcome}", code=grpc.StatusCode.INTERNAL)
        a = Attempt(k, cl.token, cl.record.attempt, lost=asyncio.Event())
        task = asyncio.ensure_future(fn(a))
        hb = asyncio.ensure_future(self._heartbeat(k, cl.fence, s.lease, a, task))
        start = time.monotonic()
        try:
            try:
                value = await task
            finally:
                self._run_times.observe(consumer, time.monotonic() - start)
                hb.cancel()
                await asyncio.gather(hb, return_exceptions=True)
            result = _core.decide(value, None, s.codec, s.result_type)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and a.lost_error is not None and task.cancelled():
                # The heartbeat cancelled the handler: the claim is lost.
                await self._release_after(k, cl.fence, a, s.bookkeeping_timeout)
                raise a.lost_error from None
            result = _core.decide(None, exc, s.codec, s.result_type)
            if result is None:
                # Shielded, so that a caller's cancellation still releases.
                await asyncio.shield(self._release_after(k, cl.fence, a, s.bookkeeping_timeout))
                raise
            try:
                await self._complete_retrying(k, cl.fence, result, s.bookkeeping_timeout)
            except errors.IdemregError as e:
                log.warning("idemreg: the final failure was not recorded", extra={"consumer": consumer, "error": str(e)})
                if hasattr(exc, "add_note"):
                    exc.add_note(f"idemreg: the final failure was not recorded: {e}")
            raise
        if result is None:  # pragma: no cover: decide stores every value
            raise AssertionError("no result for a value")
        try:
            rec = await self._complete_retrying(k, cl.fence, result, s.bookkeeping_timeout)
        except errors.IdemregError as e:
            raise errors.OutcomeNotRecordedError(f"idemreg: the handler succeeded but its outcome was not recorded: {e}", value) from e
        return OnceResult(ran=True, value=value, record=rec)

    async def _heartbeat(self, k: Key, f: Fence, lease: float, a: Attempt, task: "asyncio.Future[Any]") -> None:
        """Client._Heartbeat as a task: on a loss it cancels the handler."""
        while True:
            await asyncio.sleep(lease / 2)
            try:
                await self.extend(k, f, lease=lease, timeout=lease / 2)
            except _core.LOST as e:
                a.lost_error = e
                a.lost.set()
                task.cancel()
                return
            except Exception as e:  # the registry briefly unreachable, or the channel closed under it
                log.warning("idemreg: lease extension failed; retrying at the next beat", extra={"consumer": k.consumer, "error": str(e)})

    async def _claim_waiting(self, p: ClaimParams, wait: Optional[float], bookkeeping: float) -> Claim:
        """Client._claim_waiting."""
        p.request_id = p.request_id or _core.new_request_id()
        until = time.monotonic() + wait if wait else None
        delay = repeat_delay = _core.BACKOFF_INITIAL
        repeats = 0
        while True:
            left = max(until - time.monotonic(), 0.0) if until is not None else 0.0
            p.wait = min(_core.MAX_WAIT, left) if until is not None and left > 0 else None
            try:
                cl = await self._claim_outliving(p, bookkeeping + (p.wait or 0))
            except errors.IdemregError as e:
                if repeats < _core.CLAIM_REPEATS and _core.repeatable(e):
                    repeats += 1
                    await asyncio.sleep(_core.retry_wait(repeat_delay, e))
                    repeat_delay = min(2 * repeat_delay, _core.BACKOFF_MAX)
                    continue
                raise
            if cl.outcome == registry_pb2.OUTCOME_PARKED:
                raise errors.ParkedError(record=cl.record)
            if cl.outcome != registry_pb2.OUTCOME_IN_PROGRESS:
                return cl
            left = max(until - time.monotonic(), 0.0) if until is not None else 0.0
            if left <= 0:
                raise self._run_times.in_progress(p.key.consumer, cl.retry_after)
            sleep = min(_core.jitter(delay), left)
            if 0 < cl.retry_after < sleep:
                sleep = cl.retry_after
            await asyncio.sleep(sleep)
            delay = min(2 * delay, _core.BACKOFF_MAX)

    async def _claim_outliving(self, p: ClaimParams, timeout: float) -> Claim:
        """One Claim that outlives its caller's cancellation: a Claim cut off
        may still have acquired the key in the registry for a caller that
        never learns the token, stranding the key until its lease ran out. So
        the Claim runs on (bounded by its timeout), and a claim it acquires
        after the caller gave up is released in the background."""
        claim = asyncio.ensure_future(self._claim(p, timeout))
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            claim.add_done_callback(lambda t: self._release_abandoned(p.key, t))
            raise

    def _release_abandoned(self, k: Key, t: "asyncio.Future[Claim]") -> None:
        if t.cancelled() or t.exception() is not None or t.result().outcome != registry_pb2.OUTCOME_ACQUIRED:
            return
        fence = t.result().fence

        async def release() -> None:
            try:
                await self.release(k, fence, timeout=_core.DEFAULT_BOOKKEEPING_TIMEOUT)
            except Exception as e:  # logged: the key frees when its lease ends
                log.warning(
                    "idemreg: releasing a claim its caller gave up on failed; the key frees when its lease ends",
                    extra={"consumer": k.consumer, "error": str(e)},
                )

        f = asyncio.ensure_future(release())
        self._background.add(f)
        f.add_done_callback(self._background.discard)

    async def _complete_retrying(self, k: Key, f: Fence, r: registry_pb2.Result, bookkeeping: float) -> registry_pb2.Record:
        until = time.monotonic() + bookkeeping
        delay = _core.BACKOFF_INITIAL
        while True:
            try:
                return await self.complete(k, f, r, timeout=max(until - time.monotonic(), 0.001))
            except errors.UnavailableError as e:
                w = _core.retry_wait(delay, e)
                if time.monotonic() + w >= until:
                    raise
                await asyncio.sleep(w)
                delay = min(2 * delay, _core.BACKOFF_MAX)

    async def _release_after(self, k: Key, f: Fence, a: Attempt, bookkeeping: float) -> None:
        if a.lost_error is not None and not isinstance(a.lost_error, errors.LeaseTotalExceededError):
            return
        try:
            await self.release(k, f, timeout=bookkeeping)
        except errors.IdemregError as e:
            log.warning("idemreg: release after the work failed; the key frees when its lease ends", extra={"consumer": k.consumer, "error": str(e)})
