"""once() and the typed client against a real serve, sync and asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest

import idemreg
from conftest import Registry, unique


@pytest.fixture
def c(registry: Registry) -> Any:
    cl = registry.client()
    yield cl
    cl.close()


def test_runs_once_and_replays(c: idemreg.Client) -> None:
    key = unique()
    calls = []

    def handler(a: idemreg.Attempt) -> Any:
        calls.append(a)
        return {"applied": True, "token": a.token}

    first = c.once("py.replay", key, handler)
    assert first.ran and not first.replayed and first.value["applied"]
    assert calls[0].attempt == 1 and calls[0].token > 0
    again = c.once("py.replay", key, handler)
    assert again.replayed and not again.ran
    assert again.value == first.value
    assert len(calls) == 1
    rec = c.lookup(idemreg.Key("py.replay", key))
    assert rec.state == idemreg.v1.registry_pb2.STATE_COMPLETED


def test_bytes_codec_stores_the_bytes_as_they_are(c: idemreg.Client) -> None:
    key = unique()
    c.once("py.bytes", key, lambda a: b"\x00raw", codec=idemreg.BYTES)
    rec = c.lookup(idemreg.Key("py.bytes", key))
    assert rec.result.response.data == b"\x00raw"
    assert c.once("py.bytes", key, lambda a: b"other", codec=idemreg.BYTES).value == b"\x00raw"


def test_an_exception_releases_the_key_for_a_retry(c: idemreg.Client) -> None:
    key = unique()

    def fails(a: idemreg.Attempt) -> Any:
        raise RuntimeError("transient")

    with pytest.raises(RuntimeError, match="transient"):
        c.once("py.release", key, fails)
    res = c.once("py.release", key, lambda a: a.attempt)
    assert res.ran and res.value == 2


def test_a_final_failure_is_stored_and_replayed(c: idemreg.Client) -> None:
    key = unique()

    def declined(a: idemreg.Attempt) -> Any:
        raise idemreg.final("card declined", grpc.StatusCode.FAILED_PRECONDITION)

    with pytest.raises(idemreg.FinalError, match="card declined") as first:
        c.once("py.final", key, declined)
    assert idemreg.is_final(first.value)
    ran = []
    with pytest.raises(idemreg.StoredFailureError, match="card declined") as replayed:
        c.once("py.final", key, lambda a: ran.append(1))
    assert ran == []
    assert idemreg.is_final(replayed.value)
    assert replayed.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_another_fingerprint_is_a_mismatch(c: idemreg.Client) -> None:
    key = unique()
    c.once("py.fp", key, lambda a: 1, fingerprint=b"one")
    with pytest.raises(idemreg.FingerprintMismatchError) as e:
        c.once("py.fp", key, lambda a: 2, fingerprint=b"two")
    assert e.value.reason == "FINGERPRINT_MISMATCH"
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_concurrent_duplicates_run_the_handler_once(registry: Registry) -> None:
    key = unique()
    runs = []
    started = threading.Event()
    release = threading.Event()

    def slow(a: idemreg.Attempt) -> Any:
        runs.append(a.token)
        started.set()
        release.wait(10)
        return "done"

    results: list[Any] = []

    def worker(wait: Any) -> None:
        with registry.client() as c:
            try:
                results.append(c.once("py.dup", key, slow, wait=wait))
            except Exception as e:  # recorded, checked below
                results.append(e)

    first = threading.Thread(target=worker, args=(None,))
    first.start()
    assert started.wait(10)
    # A duplicate without wait is told to come back later.
    with registry.client() as c:
        with pytest.raises(idemreg.InProgressError) as e:
            c.once("py.dup", key, slow)
        assert e.value.retry_after > 0
    waiters = [threading.Thread(target=worker, args=(10.0,)) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.2)
    release.set()
    first.join()
    for w in waiters:
        w.join()
    assert len(runs) == 1
    assert len(results) == 5
    assert sum(1 for r in results if isinstance(r, idemreg.OnceResult) and r.ran) == 1
    assert all(isinstance(r, idemreg.OnceResult) and r.value == "done" for r in results), results


def test_a_crashed_holders_key_is_taken_over_after_its_lease(c: idemreg.Client) -> None:
    key = idemreg.Key("py.takeover", unique())
    crashed = c.claim(key, lease=0.3)
    assert crashed.outcome == idemreg.OUTCOME_ACQUIRED
    with pytest.raises(idemreg.InProgressError):
        c.once(key.consumer, key.key, lambda a: "early")
    time.sleep(0.5)
    res = c.once(key.consumer, key.key, lambda a: (a.attempt, a.token))
    assert res.ran
    attempt, token = res.value
    assert attempt == 2 and token > crashed.token
    # The crashed holder's token no longer completes.
    with pytest.raises(idemreg.LeaseLostError):
        c.complete(key, crashed.fence, idemreg.response_result(b"late"))


def test_the_heartbeat_keeps_the_key_while_the_handler_runs(registry: Registry) -> None:
    key = unique()
    seen: list[Any] = []

    def long(a: idemreg.Attempt) -> Any:
        # Four leases: without extensions the lease would end before the
        # duplicate below comes.
        time.sleep(2.4)
        seen.append(a.lost.is_set())
        return "kept"

    with registry.client() as c, registry.client() as other:
        t = threading.Thread(target=lambda: seen.append(c.once("py.hb", key, long, lease=0.6)))
        t.start()
        time.sleep(1.5)
        with pytest.raises(idemreg.InProgressError):
            other.once("py.hb", key, lambda a: "stolen")
        t.join()
    assert seen[0] is False
    assert seen[1].ran and seen[1].value == "kept"


def test_a_lost_claim_sets_attempt_lost(registry: Registry) -> None:
    key = idemreg.Key("py.lost", unique())
    with registry.client() as c:
        def handler(a: idemreg.Attempt) -> Any:
            # Someone else's Complete of a newer claim: force it by letting
            # the lease lapse under a stopped clock is not possible here, so
            # the record is taken over through Release and a fresh Claim.
            c.release(key, fence_box[0])
            taken = c.claim(key)
            assert taken.outcome == idemreg.OUTCOME_ACQUIRED
            assert a.lost.wait(5)
            return "late"

        fence_box: list[Any] = []
        orig = c._claim

        def capture(p: Any, timeout: Any) -> Any:
            cl = orig(p, timeout)
            fence_box.append(cl.fence)
            return cl

        c._claim = capture  # type: ignore[method-assign]
        with pytest.raises(idemreg.OutcomeNotRecordedError) as e:
            c.once(key.consumer, key.key, handler, lease=0.2)
        assert isinstance(e.value.__cause__, idemreg.LeaseLostError)


def test_a_registry_down_is_a_typed_error_and_the_handler_does_not_run() -> None:
    from conftest import free_port

    ran = []
    with idemreg.Client(f"127.0.0.1:{free_port()}", timeout=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(idemreg.UnavailableError) as e:
            c.once("py.down", unique(), lambda a: ran.append(1), bookkeeping_timeout=0.5)
    assert ran == []
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 10


def test_a_parked_key_is_a_parked_error(c: idemreg.Client) -> None:
    key = idemreg.Key("py.parked", unique())
    cl = c.claim(key)
    c.park(key, cl.fence, "the provider's answer was lost")
    with pytest.raises(idemreg.ParkedError) as e:
        c.once(key.consumer, key.key, lambda a: 1)
    assert e.value.record is not None and "lost" in e.value.record.park_reason


def test_errors_carry_their_error_info(c: idemreg.Client) -> None:
    with pytest.raises(idemreg.InvalidArgumentError) as e:
        c.claim(idemreg.Key("py.invalid", ""))
    assert e.value.reason == "INVALID_ARGUMENT"
    assert any(v.field == "key" for v in e.value.field_violations), e.value.field_violations
    key = idemreg.Key("py.secret", unique())
    cl = c.claim(key)
    with pytest.raises(idemreg.ClaimSecretInvalidError):
        c.complete(key, idemreg.Fence(cl.token, b"\x00" * 16), idemreg.response_result(b""))
    with pytest.raises(idemreg.NotFoundError):
        c.lookup(idemreg.Key("py.secret", unique()))


def test_a_lost_claim_reply_is_repeated_with_its_request_id(c: idemreg.Client) -> None:
    key = idemreg.Key("py.reqid", unique())
    first = c.claim(key, request_id="rid-" + unique())
    rid = "rid-" + unique()
    key2 = idemreg.Key("py.reqid", unique())
    a = c.claim(key2, request_id=rid)
    b = c.claim(key2, request_id=rid)
    assert first.outcome == a.outcome == b.outcome == idemreg.OUTCOME_ACQUIRED
    assert a.token == b.token and a.secret == b.secret
    other = c.claim(key2, request_id="rid-" + unique())
    assert other.outcome == idemreg.OUTCOME_IN_PROGRESS


def test_once_repeats_a_claim_whose_answer_was_lost(c: idemreg.Client) -> None:
    key = unique()
    seen: list[str] = []
    orig = c._claim

    def lossy(p: Any, timeout: Any) -> Any:
        seen.append(p.request_id)
        cl = orig(p, timeout)
        if len(seen) == 1:
            raise idemreg.UnavailableError("the reply was lost", code=grpc.StatusCode.UNAVAILABLE)
        return cl

    c._claim = lossy  # type: ignore[method-assign]
    res = c.once("py.lossy", key, lambda a: a.attempt)
    assert res.ran and res.value == 1
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0]


def test_batch_calls(c: idemreg.Client) -> None:
    keys = [idemreg.Key("py.batch", unique()) for _ in range(3)]
    claims = c.batch_claim([idemreg.ClaimParams(k) for k in keys] + [idemreg.ClaimParams(idemreg.Key("py.batch", ""))])
    assert [getattr(x, "outcome", None) for x in claims[:3]] == [idemreg.OUTCOME_ACQUIRED] * 3
    assert isinstance(claims[3], idemreg.InvalidArgumentError)
    recs = c.batch_complete([idemreg.CompleteParams(k, cl.fence, idemreg.response_result(b"ok")) for k, cl in zip(keys, claims)])
    assert all(r.state == idemreg.v1.registry_pb2.STATE_COMPLETED for r in recs)
    k4 = idemreg.Key("py.batch", unique())
    got = c.batch([idemreg.ClaimParams(k4), idemreg.ClaimParams(keys[0])])
    assert got[0].outcome == idemreg.OUTCOME_ACQUIRED and got[1].outcome == idemreg.OUTCOME_COMPLETED
    mixed = c.batch([idemreg.CompleteParams(k4, got[0].fence, idemreg.response_result(b"x")), idemreg.ClaimParams(k4)])
    assert mixed[1].outcome == idemreg.OUTCOME_COMPLETED and mixed[1].record.result.response.data == b"x"


def test_extend_and_release(c: idemreg.Client) -> None:
    key = idemreg.Key("py.extend", unique())
    cl = c.claim(key, lease=1.0)
    rec = c.extend(key, cl.fence, lease=5.0)
    assert rec.lease_expires_at.ToDatetime() > cl.record.lease_expires_at.ToDatetime()
    c.release(key, cl.fence)
    again = c.claim(key)
    assert again.outcome == idemreg.OUTCOME_ACQUIRED and again.token > cl.token


def test_decorator(c: idemreg.Client) -> None:
    calls = []

    @c.once("py.decorated", key=lambda msg: msg["id"])
    def handle(msg: dict[str, Any]) -> Any:
        calls.append(idemreg.current_attempt().token)
        return msg["amount"] * 2

    msg = {"id": unique(), "amount": 21}
    assert handle(msg) == 42
    assert handle(msg) == 42
    assert len(calls) == 1 and calls[0] > 0


def test_a_deadline_per_call(c: idemreg.Client) -> None:
    # A Claim asking to wait for a holder longer than its deadline: the
    # registry answers by the deadline it was sent.
    key = idemreg.Key("py.deadline", unique())
    c.claim(key, lease=5.0)
    t0 = time.monotonic()
    try:
        cl = c.claim(key, wait=3.0, timeout=0.3)
        assert cl.outcome == idemreg.OUTCOME_IN_PROGRESS
    except idemreg.DeadlineExceededError:
        pass  # its answer came after the deadline, on a loaded machine
    assert time.monotonic() - t0 < 2.5


def test_asyncio(registry: Registry) -> None:
    async def main() -> None:
        async with registry.async_client() as c:
            key = unique()
            calls = []

            async def handler(a: idemreg.Attempt) -> Any:
                calls.append(a.token)
                await asyncio.sleep(0.01)
                return [a.attempt]

            first = await c.once("py.aio", key, handler)
            again = await c.once("py.aio", key, handler)
            assert first.ran and again.replayed and again.value == [1] and len(calls) == 1

            # Concurrent duplicates on one loop: one run, every caller the outcome.
            dup = unique()
            runs = []

            async def slow(a: idemreg.Attempt) -> Any:
                runs.append(1)
                await asyncio.sleep(0.3)
                return "done"

            res = await asyncio.gather(*[c.once("py.aio.dup", dup, slow, wait=10.0, fingerprint=b"one") for _ in range(5)])
            assert len(runs) == 1 and all(r.value == "done" for r in res)

            with pytest.raises(idemreg.FingerprintMismatchError):
                await c.once("py.aio.dup", dup, slow, fingerprint=b"other")

            @c.once("py.aio.dec", key=lambda m: m)
            async def handle(m: str) -> Any:
                return idemreg.current_attempt().attempt

            k = unique()
            assert await handle(k) == 1 and await handle(k) == 1

            # The heartbeat's loss cancels the handler and is raised.
            lost_key = idemreg.Key("py.aio.lost", unique())
            box: list[Any] = []
            orig = c._claim

            async def capture(p: Any, timeout: Any) -> Any:
                cl = await orig(p, timeout)
                box.append(cl.fence)
                return cl

            c._claim = capture  # type: ignore[method-assign]

            async def taken_over(a: idemreg.Attempt) -> Any:
                await c.release(lost_key, box[0])
                await c.claim(lost_key)
                await asyncio.sleep(10)

            with pytest.raises(idemreg.LeaseLostError):
                await c.once(lost_key.consumer, lost_key.key, taken_over, lease=0.2)

        from conftest import free_port

        async with idemreg.AsyncClient(f"127.0.0.1:{free_port()}", timeout=0.5) as down:
            with pytest.raises(idemreg.UnavailableError):
                await down.once("py.aio.down", unique(), handler, bookkeeping_timeout=0.5)

    asyncio.run(main())


def test_in_progress_retry_after_is_the_consumers_mean_run_time(registry: Registry) -> None:
    consumer = "py.runtime." + unique()
    with registry.client() as c, registry.client() as holder:
        k = idemreg.Key(consumer, unique())
        held = holder.claim(k, lease=5.0)
        with pytest.raises(idemreg.InProgressError) as before:
            c.once(consumer, k.key, lambda a: 1)
        assert before.value.retry_after == pytest.approx(1.0)  # the default before any run
        c.once(consumer, unique(), lambda a: time.sleep(0.2))
        with pytest.raises(idemreg.InProgressError) as after:
            c.once(consumer, k.key, lambda a: 1)
        # The registry's own figure is the ~5 s left on the holder's lease.
        assert 0.15 <= after.value.retry_after <= 0.5
        holder.release(k, held.fence)


def test_batches_split_by_items_and_bytes() -> None:
    from idemreg import _core

    assert [len(p) for p in _core.chunks(list(range(1001)), [10] * 1001)] == [500, 500, 1]
    big = _core.MAX_BATCH_BYTES // 3 + 1
    assert [len(p) for p in _core.chunks(list(range(7)), [big] * 7)] == [2, 2, 2, 1]
    assert _core.chunks([], []) == []


def test_asyncio_a_claim_its_caller_gave_up_on_is_released(registry: Registry) -> None:
    async def main() -> None:
        async with registry.async_client() as c:
            key = idemreg.Key("py.aio.abandoned", unique())
            orig = c._claim
            answered = asyncio.Event()

            async def slow(p: Any, timeout: Any) -> Any:
                await asyncio.sleep(0.3)  # the caller gives up meanwhile
                cl = await orig(p, timeout)
                answered.set()
                return cl

            c._claim = slow  # type: ignore[method-assign]
            task = asyncio.ensure_future(c.once(key.consumer, key.key, lambda a: asyncio.sleep(0)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(answered.wait(), 5)
            c._claim = orig  # type: ignore[method-assign]
            for _ in range(100):
                if not c._background:
                    break
                await asyncio.sleep(0.02)
            # The abandoned claim acquired the key, and was released: the
            # next Claim acquires at once, as attempt 2.
            cl = await c.claim(key)
            assert cl.outcome == idemreg.OUTCOME_ACQUIRED and cl.record.attempt == 2

    asyncio.run(main())
