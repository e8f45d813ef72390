"""The synchronous client (grpc): the registry's calls, typed, and once()."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from typing import Any, Callable, Optional, TypeVar, Union, overload

import grpc

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
from idemreg.codec import JSON, Codec
from idemreg.credentials import Target
from idemreg.v1 import registry_pb2
from idemreg.v1.registry_pb2_grpc import RegistryServiceStub

log = logging.getLogger("idemreg")

T = TypeVar("T")

_attempt: contextvars.ContextVar[Attempt] = contextvars.ContextVar("idemreg_attempt")


def current_attempt() -> Attempt:
    """The claim the calling handler runs under, for a function decorated
    with ``Client.once`` (or ``AsyncClient.once``): its token fences the
    handler's writes. LookupError outside one."""
    return _attempt.get()


class Client:
    """A client of the registry over one grpc channel.

    ``Client("127.0.0.1:7350")`` dials plaintext; ``tls=True`` (or
    ``root_certificates=...``) dials TLS, and ``token`` authenticates every
    call with a bearer token (refused over plaintext unless
    ``insecure_token=True``). ``channel=`` takes a channel of your own.
    ``timeout`` (seconds) is each call's deadline unless the call gives its
    own. Every method raises the :mod:`idemreg.errors` class of the status.
    """

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        channel: Optional[grpc.Channel] = None,
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
                raise ValueError("Client needs a target or a channel")
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
                channel = grpc.secure_channel(t.target, t.credentials, options=t.options)
            else:
                channel = grpc.insecure_channel(t.target, options=t.options)
        self.channel = channel
        self._stub = RegistryServiceStub(channel)
        self.timeout = timeout
        self.holder = holder
        self._run_times = _core.RunTimes()

    def close(self) -> None:
        """Closes the channel, if this client opened it."""
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: Any, req: Any, timeout: Optional[float]) -> Any:
        try:
            return method(req, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata or None)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    # The registry's calls.

    def claim(
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
        """Claims key: acquired (with a token and secret), in progress
        elsewhere, completed (the record holds the result) or parked. Repeat a
        Claim whose answer was lost with the same ``request_id`` to get the
        same token back. ``wait`` asks the registry to hold the call while
        another holder has the key (at most 30 s)."""
        p = ClaimParams(key, fingerprint, lease, retention, holder, request_id, wait)
        return self._claim(p, timeout)

    def _claim(self, p: ClaimParams, timeout: Optional[float]) -> Claim:
        return Claim.of(self._call(self._stub.Claim, p.request(self.holder), timeout))

    def complete(self, key: Key, fence: Fence, result: registry_pb2.Result, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """Stores result (``response_result`` or ``failure_result``) under the claim's fence."""
        req = CompleteParams(key, fence, result).request()
        resp: registry_pb2.CompleteResponse = self._call(self._stub.Complete, req, timeout)
        return resp.record

    def release(self, key: Key, fence: Fence, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """Gives up the claim without a result: the next Claim acquires at once."""
        req = registry_pb2.ReleaseRequest(consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, claim_secret=fence.secret)
        resp: registry_pb2.ReleaseResponse = self._call(self._stub.Release, req, timeout)
        return resp.record

    def extend(self, key: Key, fence: Fence, *, lease: Optional[float] = None, timeout: Optional[float] = None) -> registry_pb2.Record:
        """Renews the claim's lease from now (the claim's lease when None)."""
        req = registry_pb2.ExtendRequest(
            consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, lease=_core.duration(lease), claim_secret=fence.secret
        )
        resp: registry_pb2.ExtendResponse = self._call(self._stub.Extend, req, timeout)
        return resp.record

    def park(self, key: Key, fence: Fence, reason: str, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """Parks the key: its outcome is unknown and it must not be done again."""
        req = registry_pb2.ParkRequest(consumer=key.consumer, kind=key.kind, key=key.key, token=fence.token, reason=reason, claim_secret=fence.secret)
        resp: registry_pb2.ParkResponse = self._call(self._stub.Park, req, timeout)
        return resp.record

    def lookup(self, key: Key, *, timeout: Optional[float] = None) -> registry_pb2.Record:
        """The live record of key; NotFoundError when there is none."""
        req = registry_pb2.LookupRequest(consumer=key.consumer, kind=key.kind, key=key.key)
        resp: registry_pb2.LookupResponse = self._call(self._stub.Lookup, req, timeout)
        return resp.record

    def batch_claim(self, claims: list[ClaimParams], *, timeout: Optional[float] = None) -> list[Union[Claim, errors.IdemregError]]:
        """Claims many keys: one answer per item, in order, each a Claim or the
        typed error Claim would have raised. Calls of at most 500 items."""
        out: list[Union[Claim, errors.IdemregError]] = []
        reqs = [p.request(self.holder) for p in claims]
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            req = registry_pb2.BatchClaimRequest(requests=part)
            resp: registry_pb2.BatchClaimResponse = self._call(self._stub.BatchClaim, req, timeout)
            for r in resp.results:
                out.append(Claim.of(r.response) if r.WhichOneof("result") == "response" else _item_error(r.error))
        return out

    def batch_complete(self, completes: list[CompleteParams], *, timeout: Optional[float] = None) -> list[Union[registry_pb2.Record, errors.IdemregError]]:
        """Completes many claims: one record or typed error per item, in order."""
        out: list[Union[registry_pb2.Record, errors.IdemregError]] = []
        reqs = [p.request() for p in completes]
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            req = registry_pb2.BatchCompleteRequest(requests=part)
            resp: registry_pb2.BatchCompleteResponse = self._call(self._stub.BatchComplete, req, timeout)
            for r in resp.results:
                out.append(r.response.record if r.WhichOneof("result") == "response" else _item_error(r.error))
        return out

    def batch(self, items: list[BatchItem], *, timeout: Optional[float] = None) -> list[BatchAnswer]:
        """Claims and completes many keys in one call, decided together: per
        item a Claim (for a ClaimParams), a Record (for a CompleteParams) or
        the typed error. Items on one key are decided in order."""
        out: list[BatchAnswer] = []
        reqs = _core.batch_items(items, self.holder)
        for part in _core.chunks(reqs, [r.ByteSize() for r in reqs]):
            out.extend(_core.batch_answers(self._call(self._stub.Batch, registry_pb2.BatchRequest(items=part), timeout)))
        return out

    # once.

    @overload
    def once(
        self,
        consumer: str,
        key: str,
        fn: Callable[[Attempt], Any],
        *,
        kind: int = _core.KIND_MESSAGE,
        fingerprint: bytes = b"",
        lease: float = _core.DEFAULT_LEASE,
        retention: Optional[float] = None,
        wait: Optional[float] = None,
        codec: Codec = JSON,
        result_type: str = "",
        bookkeeping_timeout: float = _core.DEFAULT_BOOKKEEPING_TIMEOUT,
    ) -> OnceResult: ...

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
    ) -> Callable[[Callable[..., T]], Callable[..., T]]: ...

    def once(
        self,
        consumer: str,
        key: Union[str, Callable[..., str]],
        fn: Optional[Callable[[Attempt], Any]] = None,
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
        """Runs fn at most once to completion per key of consumer, and gives
        every duplicate the stored outcome (the Go client's ``Once``):

        - acquired: ``fn(attempt)`` runs while the lease is extended every
          half lease; its value is stored (``codec``, JSON by default) and
          returned in ``OnceResult(ran=True)``. Should the registry report
          the claim lost, ``attempt.lost`` is set.
        - fn raises a :class:`FinalError` (``final(...)``): the failure is
          stored, replayed to duplicates, and raised.
        - fn raises anything else: the key is released for a retry, and the
          exception raised.
        - completed: fn does not run; ``OnceResult(replayed=True)`` with the
          stored value, or the stored failure raised as a StoredFailureError.
        - in progress elsewhere: InProgressError, or with ``wait`` (seconds)
          the outcome (or a takeover) is waited for.
        - parked: ParkedError with the record.
        - unreachable: UnavailableError after three Claims with one request id.

        Without fn it is a decorator: ``key`` is the message id or a function
        of the decorated function's arguments giving it; the decorated
        function returns fn's value (or the replayed one), and
        :func:`current_attempt` gives it the token.
        """
        settings = _core.OnceSettings(kind, fingerprint, lease, retention, wait, codec, result_type, bookkeeping_timeout)
        if fn is not None:
            if callable(key):
                raise TypeError("once: key must be the message id when fn is given")
            return self._once(consumer, key, fn, settings)

        def decorator(f: Callable[..., T]) -> Callable[..., T]:
            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> T:
                def handler(a: Attempt) -> Any:
                    reset = _attempt.set(a)
                    try:
                        return f(*args, **kwargs)
                    finally:
                        _attempt.reset(reset)

                res = self._once(consumer, _core.call_key(key, args, kwargs), handler, settings)
                return res.value  # type: ignore[no-any-return]

            return wrapper

        return decorator

    def _once(
        self,
        consumer: str,
        message_id: str,
        fn: Callable[[Attempt], Any],
        s: _core.OnceSettings,
    ) -> OnceResult:
        k = Key(consumer, message_id, s.kind)
        p = ClaimParams(k, s.fingerprint, s.lease, s.retention)
        cl = self._claim_waiting(p, s.wait, s.bookkeeping_timeout)
        if cl.outcome == registry_pb2.OUTCOME_COMPLETED:
            return _core.replay(cl.record, s.codec)
        if cl.outcome != registry_pb2.OUTCOME_ACQUIRED:
            raise errors.InternalError(f"an unexpected claim outcome {cl.outcome}", code=grpc.StatusCode.INTERNAL)
        a = Attempt(k, cl.token, cl.record.attempt, lost=threading.Event())
        hb = _Heartbeat(self, k, cl.fence, s.lease, a)
        start = time.monotonic()
        try:
            value = fn(a)
            self._run_times.observe(consumer, time.monotonic() - start)
            result = _core.decide(value, None, s.codec, s.result_type)
        except BaseException as exc:
            self._run_times.observe(consumer, time.monotonic() - start)
            hb.stop()
            result = _core.decide(None, exc, s.codec, s.result_type)
            if result is None:
                self._release_after(k, cl.fence, a, s.bookkeeping_timeout)
                raise
            try:
                self._complete_retrying(k, cl.fence, result, s.bookkeeping_timeout)
            except errors.IdemregError as e:
                log.warning("idemreg: the final failure was not recorded", extra={"consumer": consumer, "error": str(e)})
                if hasattr(exc, "add_note"):
                    exc.add_note(f"idemreg: the final failure was not recorded: {e}")
            raise
        hb.stop()
        if result is None:  # pragma: no cover: decide stores every value
            raise AssertionError("no result for a value")
        try:
            rec = self._complete_retrying(k, cl.fence, result, s.bookkeeping_timeout)
        except errors.IdemregError as e:
            raise errors.OutcomeNotRecordedError(f"idemreg: the handler succeeded but its outcome was not recorded: {e}", value) from e
        return OnceResult(ran=True, value=value, record=rec)

    def _claim_waiting(self, p: ClaimParams, wait: Optional[float], bookkeeping: float) -> Claim:
        """Claims p with one request id, repeating a Claim whose answer was
        lost up to three times, and, with wait, waiting for a holder's outcome."""
        p.request_id = p.request_id or _core.new_request_id()
        until = time.monotonic() + wait if wait else None
        delay = repeat_delay = _core.BACKOFF_INITIAL
        repeats = 0
        while True:
            left = max(until - time.monotonic(), 0.0) if until is not None else 0.0
            p.wait = min(_core.MAX_WAIT, left) if until is not None and left > 0 else None
            try:
                cl = self._claim(p, bookkeeping + (p.wait or 0))
            except errors.IdemregError as e:
                if repeats < _core.CLAIM_REPEATS and _core.repeatable(e):
                    repeats += 1
                    time.sleep(_core.retry_wait(repeat_delay, e))
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
            # Never sleep past the holder's lease: a crashed holder's key can
            # be taken over from then on.
            sleep = min(_core.jitter(delay), left)
            if 0 < cl.retry_after < sleep:
                sleep = cl.retry_after
            time.sleep(sleep)
            delay = min(2 * delay, _core.BACKOFF_MAX)

    def _complete_retrying(self, k: Key, f: Fence, r: registry_pb2.Result, bookkeeping: float) -> registry_pb2.Record:
        """Complete, repeated while the registry is unavailable, within the
        bookkeeping timeout: repeating a Complete with one token is safe."""
        until = time.monotonic() + bookkeeping
        delay = _core.BACKOFF_INITIAL
        while True:
            try:
                return self.complete(k, f, r, timeout=max(until - time.monotonic(), 0.001))
            except errors.UnavailableError as e:
                w = _core.retry_wait(delay, e)
                if time.monotonic() + w >= until:
                    raise
                time.sleep(w)
                delay = min(2 * delay, _core.BACKOFF_MAX)

    def _release_after(self, k: Key, f: Fence, a: Attempt, bookkeeping: float) -> None:
        # A claim whose heartbeat reported it lost is someone else's now.
        if a.lost_error is not None and not isinstance(a.lost_error, errors.LeaseTotalExceededError):
            return
        try:
            self.release(k, f, timeout=bookkeeping)
        except errors.IdemregError as e:
            log.warning("idemreg: release after the work failed; the key frees when its lease ends", extra={"consumer": k.consumer, "error": str(e)})


def _item_error(st: Any) -> errors.IdemregError:
    return errors.from_status(st) or errors.InternalError("an empty batch result", code=grpc.StatusCode.INTERNAL)


class _Heartbeat:
    """Extends a claim every half lease until stopped. When the registry says
    the claim is gone or can be extended no more, it records the loss on the
    attempt and stops; other failures (the registry briefly unreachable) are
    retried at the next beat, the lease still having half its length."""

    def __init__(self, c: Client, k: Key, f: Fence, lease: float, a: Attempt) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(c, k, f, lease, a), name="idemreg-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, c: Client, k: Key, f: Fence, lease: float, a: Attempt) -> None:
        while not self._stop.wait(lease / 2):
            try:
                c.extend(k, f, lease=lease, timeout=lease / 2)
            except _core.LOST as e:
                a.lost_error = e
                a.lost.set()
                return
            except Exception as e:  # the registry briefly unreachable, or the channel closed under it
                if not self._stop.is_set():
                    log.warning("idemreg: lease extension failed; retrying at the next beat", extra={"consumer": k.consumer, "error": str(e)})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
