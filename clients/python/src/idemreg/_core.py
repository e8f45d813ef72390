"""What the sync and asyncio clients share: the calls' requests and
answers, and Once's decisions, kept free of I/O so both run the same rules."""

from __future__ import annotations

import base64
import random
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import grpc
from google.protobuf import duration_pb2

from idemreg import errors
from idemreg.codec import Codec
from idemreg.v1 import registry_pb2

Kind = registry_pb2.Kind
Outcome = registry_pb2.Outcome

KIND_MESSAGE = registry_pb2.KIND_MESSAGE
KIND_OPERATION = registry_pb2.KIND_OPERATION

# The Go client's defaults (client/options.go), in seconds.
DEFAULT_LEASE = 30.0
DEFAULT_BOOKKEEPING_TIMEOUT = 5.0
DEFAULT_TIMEOUT = 10.0
DEFAULT_IN_PROGRESS_RETRY = 1.0
MIN_IN_PROGRESS_RETRY = 0.05
BACKOFF_INITIAL = 0.05
BACKOFF_MAX = 1.0
# The longest wait a Claim may ask the registry for.
MAX_WAIT = 30.0
# How many times a Claim whose answer was lost is repeated with its request id.
CLAIM_REPEATS = 3
# The registry's bounds on one batch call.
MAX_BATCH_ITEMS = 500

# The errors that end a heartbeat: the claim is gone or can be extended no more.
LOST = (
    errors.LeaseLostError,
    errors.NotFoundError,
    errors.AlreadyCompletedError,
    errors.LeaseTotalExceededError,
    errors.ClaimSecretInvalidError,
)


def new_request_id() -> str:
    """A random, unguessable request id: 26 base32 characters, as Go's rand.Text."""
    return base64.b32encode(secrets.token_bytes(16)).decode().rstrip("=")


def jitter(d: float) -> float:
    return d * (0.8 + 0.4 * random.random())


def duration(seconds: Optional[float]) -> Optional[duration_pb2.Duration]:
    if seconds is None or seconds <= 0:
        return None
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def seconds(d: duration_pb2.Duration) -> float:
    return float(d.seconds) + float(d.nanos) / 1e9


@dataclass(frozen=True)
class Key:
    """A record's identity: (consumer, kind, key)."""

    consumer: str
    key: str
    kind: int = KIND_MESSAGE


@dataclass(frozen=True)
class Fence:
    """What Complete, Release and Extend of a claim carry: its token and the
    claim secret only the Claim's answer had. Keep it as private as a password."""

    token: int
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class Claim:
    """The answer to a Claim. ``retry_after`` is in seconds (in progress)."""

    outcome: int
    token: int
    retry_after: float
    record: registry_pb2.Record
    secret: bytes = field(repr=False)

    @property
    def fence(self) -> Fence:
        return Fence(self.token, self.secret)

    @staticmethod
    def of(r: registry_pb2.ClaimResponse) -> "Claim":
        return Claim(r.outcome, r.token, seconds(r.retry_after), r.record, r.claim_secret)


@dataclass
class ClaimParams:
    """One Claim, for claim and the batch calls. Durations are seconds; None
    takes the registry's default."""

    key: Key
    fingerprint: bytes = b""
    lease: Optional[float] = None
    retention: Optional[float] = None
    holder: str = ""
    request_id: str = ""
    wait: Optional[float] = None

    def request(self, holder: str) -> registry_pb2.ClaimRequest:
        return registry_pb2.ClaimRequest(
            consumer=self.key.consumer,
            kind=self.key.kind,
            key=self.key.key,
            fingerprint=self.fingerprint,
            lease=duration(self.lease),
            retention=duration(self.retention),
            holder=self.holder or holder,
            request_id=self.request_id,
            wait=duration(self.wait),
        )


def response_result(data: bytes, type_: str = "") -> registry_pb2.Result:
    """A successful result to store: data and the name of its type."""
    return registry_pb2.Result(response=registry_pb2.Response(type=type_, data=data))


def failure_result(code: grpc.StatusCode, message: str) -> registry_pb2.Result:
    """A final failure to store, replayed as a StoredFailureError."""
    return registry_pb2.Result(failure=registry_pb2.Failure(code=code.value[0], message=message))


@dataclass
class CompleteParams:
    """One Complete, for complete and the batch calls."""

    key: Key
    fence: Fence
    result: registry_pb2.Result

    def request(self) -> registry_pb2.CompleteRequest:
        return registry_pb2.CompleteRequest(
            consumer=self.key.consumer,
            kind=self.key.kind,
            key=self.key.key,
            token=self.fence.token,
            result=self.result,
            claim_secret=self.fence.secret,
        )


BatchItem = Union[ClaimParams, CompleteParams]
BatchAnswer = Union[Claim, registry_pb2.Record, errors.IdemregError]


def batch_items(items: list[BatchItem], holder: str) -> list[registry_pb2.BatchItem]:
    return [
        registry_pb2.BatchItem(claim=it.request(holder)) if isinstance(it, ClaimParams) else registry_pb2.BatchItem(complete=it.request())
        for it in items
    ]


def batch_answers(resp: registry_pb2.BatchResponse) -> list[BatchAnswer]:
    out: list[BatchAnswer] = []
    for r in resp.results:
        which = r.WhichOneof("result")
        if which == "claim":
            out.append(Claim.of(r.claim))
        elif which == "complete":
            out.append(r.complete.record)
        else:
            out.append(errors.from_status(r.error) or errors.InternalError("an empty batch result", code=grpc.StatusCode.INTERNAL))
    return out


# The registry's bound on the bytes of one batch call, less room for the
# envelope.
MAX_BATCH_BYTES = (4 << 20) - (64 << 10)


def chunks(items: list[Any], sizes: list[int]) -> list[list[Any]]:
    """items in calls of at most MAX_BATCH_ITEMS and MAX_BATCH_BYTES (an item
    larger than that alone in its call, for the registry to refuse)."""
    out: list[list[Any]] = []
    part: list[Any] = []
    size = 0
    for it, n in zip(items, sizes):
        if part and (len(part) == MAX_BATCH_ITEMS or size + n > MAX_BATCH_BYTES):
            out.append(part)
            part, size = [], 0
        part.append(it)
        size += n
    if part:
        out.append(part)
    return out


@dataclass
class Attempt:
    """The claim a handler runs under. Make the handler's effect conditional
    on ``token`` (a write fenced with ``WHERE token < :token``): a holder whose
    lease ran out may still be running when another takes over. ``attempt``
    above 1 says an earlier holder may have done part of the work.

    ``lost`` is set (with ``lost_error``) when the registry reports the claim
    gone while the handler runs; stop before the lease ends."""

    key: Key
    token: int
    attempt: int
    lost: Any = field(repr=False, default=None)
    lost_error: Optional[BaseException] = field(repr=False, default=None)

    def check(self) -> None:
        """Raises the loss the heartbeat saw, if any."""
        if self.lost_error is not None:
            raise self.lost_error


@dataclass
class OnceResult:
    """What once did: ``ran`` (the handler ran now) or ``replayed`` (it had
    run before; ``value`` is what it returned then)."""

    ran: bool = False
    replayed: bool = False
    value: Any = None
    record: Optional[registry_pb2.Record] = None


def replay(rec: registry_pb2.Record, codec: Codec) -> OnceResult:
    """The stored outcome of a completed record: its value, or its final failure raised."""
    which = rec.result.WhichOneof("outcome") if rec.HasField("result") else None
    if which == "failure":
        f = rec.result.failure
        raise errors.StoredFailureError(f.message, errors.code_of(f.code))
    if which != "response":
        raise errors.InternalError("a completed record without a result", code=grpc.StatusCode.INTERNAL)
    return OnceResult(replayed=True, value=codec.decode(rec.result.response.data), record=rec)


# How many consumers RunTimes follows: a caller that invents consumer
# names must not grow it without end.
MAX_TIMED_CONSUMERS = 1024


class RunTimes:
    """What an InProgressError's retry_after is estimated from, as the Go
    client does: per consumer, a moving average (weight 1/8 per run) of how
    long this client's handlers took. The registry's own retry_after is the
    time left on the holder's lease, which a heartbeat keeps between half a
    lease and a lease whatever the work's length: a duplicate told that
    would come back long after the answer is in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._avg: dict[str, float] = {}

    def observe(self, consumer: str, d: float) -> None:
        with self._lock:
            old = self._avg.get(consumer)
            if old is not None:
                self._avg[consumer] = old + (d - old) / 8
            elif len(self._avg) < MAX_TIMED_CONSUMERS:
                self._avg[consumer] = d

    def retry_after(self, consumer: str, lease_left: float) -> float:
        """The consumer's mean run time (1 s before any), at least 50 ms, at
        most the time left on the holder's lease."""
        with self._lock:
            d = self._avg.get(consumer, DEFAULT_IN_PROGRESS_RETRY)
        d = max(d, MIN_IN_PROGRESS_RETRY)
        if lease_left > 0:
            d = min(d, lease_left)
        return d

    def in_progress(self, consumer: str, lease_left: float) -> errors.InProgressError:
        return errors.InProgressError(retry_after=self.retry_after(consumer, lease_left))


def repeatable(err: BaseException) -> bool:
    """A Claim whose answer was lost: repeated with its request id."""
    return isinstance(err, (errors.UnavailableError, errors.DeadlineExceededError))


def retry_wait(delay: float, err: BaseException) -> float:
    """The jittered delay, or the registry's RetryInfo when that is longer."""
    w = jitter(delay)
    if isinstance(err, errors.UnavailableError):
        w = max(w, err.retry_after)
    return w


def decide(value: Any, exc: Optional[BaseException], codec: Codec, result_type: str) -> Optional[registry_pb2.Result]:
    """What to record for a handler's return: the result to store, or None
    for a release (anything but a final failure raised)."""
    if exc is None:
        return response_result(codec.encode(value), result_type)
    if isinstance(exc, errors.FinalError):
        return failure_result(exc.code, exc.message)
    return None


@dataclass(frozen=True)
class OnceSettings:
    """once's options, documented on Client.once."""

    kind: int = KIND_MESSAGE
    fingerprint: bytes = b""
    lease: float = DEFAULT_LEASE
    retention: Optional[float] = None
    wait: Optional[float] = None
    codec: Codec = field(default_factory=lambda: _json())
    result_type: str = ""
    bookkeeping_timeout: float = DEFAULT_BOOKKEEPING_TIMEOUT


def _json() -> Codec:
    from idemreg.codec import JSON

    return JSON


def call_key(key: Union[str, Callable[..., str]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return key(*args, **kwargs) if callable(key) else key
