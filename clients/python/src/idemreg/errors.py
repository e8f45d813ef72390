"""Typed errors rebuilt from the registry's statuses.

Every error of the registry carries a ``google.rpc.ErrorInfo`` (domain
``idemreg.dev``) whose reason names what happened; :func:`from_rpc_error`
turns a ``grpc.RpcError`` into the class of that reason, so callers write
``except FingerprintMismatchError`` instead of parsing codes. The classes are
the Go client's sentinels (``ErrFingerprintMismatch`` is
:class:`FingerprintMismatchError`, ``*UnavailableError`` is
:class:`UnavailableError`, ...).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import grpc

from idemreg._rpc import error_details_pb2, status_pb2
from idemreg.v1 import registry_pb2

ERROR_DOMAIN = "idemreg.dev"
# The domain registries sent before ERROR_DOMAIN, which the Go client still
# accepts for one release.
_LEGACY_ERROR_DOMAIN = "idemreg"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_TYPE_PREFIX = "type.googleapis.com/"


class FieldViolation:
    """One invalid field of a request (``google.rpc.BadRequest``)."""

    __slots__ = ("field", "description")

    def __init__(self, field: str, description: str) -> None:
        self.field = field
        self.description = description

    def __repr__(self) -> str:
        return f"FieldViolation({self.field!r}, {self.description!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldViolation) and (self.field, self.description) == (other.field, other.description)


class IdemregError(Exception):
    """An error status of the registry, with its details decoded.

    ``reason`` is the ErrorInfo reason (empty for a transport error, such as a
    refused connection); ``retry_after`` the RetryInfo delay in seconds (0
    when there was none).
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        metadata: Optional[dict[str, str]] = None,
        field_violations: Optional[list[FieldViolation]] = None,
        retry_after: float = 0.0,
    ) -> None:
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})
        self.field_violations: list[FieldViolation] = list(field_violations or [])
        self.retry_after = retry_after
        super().__init__(f"idemreg: {reason or code.name}: {message}")


class InvalidArgumentError(IdemregError):
    """INVALID_ARGUMENT (and MALFORMED_REQUEST): ``field_violations`` say which fields."""


class FingerprintMismatchError(IdemregError):
    """The key was used with different parameters (another fingerprint)."""


class LeaseLostError(IdemregError):
    """Another holder took over the key: the token is no longer the current one."""


class ClaimSecretInvalidError(IdemregError):
    """The claim secret verifies under none of the registry's claim keys."""


class AlreadyCompletedError(IdemregError):
    """The key is already completed."""


class ParkedError(IdemregError):
    """The key is parked: do not do the work; dead-letter or skip the message.

    ``record`` is the parked record when a Claim reported it (its
    ``park_reason`` says why), None when rebuilt from a status.
    """

    def __init__(self, message: str = "the key is parked; do not do the work", *, record: Optional[registry_pb2.Record] = None, **kw: Any) -> None:
        kw.setdefault("code", grpc.StatusCode.FAILED_PRECONDITION)
        kw.setdefault("reason", "PARKED")
        if record is not None and record.park_reason:
            message = f"the key is parked ({record.park_reason}); do not do the work"
        super().__init__(message, **kw)
        self.record = record


class LeaseTotalExceededError(IdemregError):
    """An Extend would hold the key past the consumer's max_lease_total."""


class QuotaExceededError(IdemregError):
    """The consumer is at its quota of records."""


class NotFoundError(IdemregError):
    """No live record for the key."""


class CapacityExhaustedError(IdemregError):
    """The registry is short of a resource; Claims that would start work are refused."""


class UnavailableError(IdemregError):
    """The registry (or its store) could not answer: retry after ``retry_after``.

    ``not_run`` is true for an interceptor's REGISTRY_UNAVAILABLE: the call
    was not run and can be retried as it is.
    """

    @property
    def not_run(self) -> bool:
        return self.reason == "REGISTRY_UNAVAILABLE"


class DeadlineExceededError(IdemregError):
    """The call's deadline passed (on this side or the registry's)."""


class CanceledError(IdemregError):
    """The call was cancelled."""


class InternalError(IdemregError):
    """The registry failed in a way no retry is known to fix."""


class UnauthenticatedError(IdemregError):
    """The registry does not know the caller (or the token was refused before sending)."""


class PermissionDeniedError(IdemregError):
    """The caller's identity may not use the consumer."""


class RateLimitedError(IdemregError):
    """The consumer's or the identity's rate limit (or its calls in progress) was reached."""


class InProgressError(IdemregError):
    """Another holder has a live claim on the key; retry after ``retry_after`` seconds."""

    def __init__(self, message: str = "", **kw: Any) -> None:
        kw.setdefault("code", grpc.StatusCode.ABORTED)
        kw.setdefault("reason", "IN_PROGRESS")
        retry = kw.get("retry_after", 0.0)
        super().__init__(message or f"the key is in progress elsewhere; retry after {retry:.3f}s", **kw)


class MissingKeyError(IdemregError):
    """An interceptor's answer to a call without an idempotency key."""


class KeyUnsupportedError(IdemregError):
    """An interceptor's answer to a streaming call that carries an idempotency key."""


class StoredResultUnreadableError(IdemregError):
    """The key is completed but its stored reply does not decode as the call's reply."""


_BY_REASON: dict[str, type[IdemregError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "MALFORMED_REQUEST": InvalidArgumentError,
    "FINGERPRINT_MISMATCH": FingerprintMismatchError,
    "LEASE_LOST": LeaseLostError,
    "CLAIM_SECRET_INVALID": ClaimSecretInvalidError,
    "ALREADY_COMPLETED": AlreadyCompletedError,
    "PARKED": ParkedError,
    "LEASE_TOTAL_EXCEEDED": LeaseTotalExceededError,
    "QUOTA_EXCEEDED": QuotaExceededError,
    "NOT_FOUND": NotFoundError,
    "STORE_UNAVAILABLE": UnavailableError,
    "REGISTRY_UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELED": CanceledError,
    "INTERNAL": InternalError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "RATE_LIMITED": RateLimitedError,
    "TOO_MANY_CALLS": RateLimitedError,
    "OVERLOADED": UnavailableError,
    "CAPACITY_EXHAUSTED": CapacityExhaustedError,
    "IN_PROGRESS": InProgressError,
    "IDEMPOTENCY_KEY_MISSING": MissingKeyError,
    "IDEMPOTENCY_KEY_UNSUPPORTED": KeyUnsupportedError,
    "STORED_RESULT_UNREADABLE": StoredResultUnreadableError,
}

# A status without an idemreg ErrorInfo comes from the transport: the
# registry is down, or the caller's own deadline or cancellation hit first.
_BY_CODE: dict[grpc.StatusCode, type[IdemregError]] = {
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CanceledError,
}

_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def code_of(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number (UNKNOWN if there is none)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def from_status(st: status_pb2.Status) -> Optional[IdemregError]:
    """The typed error of a google.rpc.Status (a batch item's error); None for OK."""
    if st.code == 0:
        return None
    return _typed(code_of(st.code), st.message, st.details)


def from_rpc_error(err: BaseException) -> BaseException:
    """The typed error of a ``grpc.RpcError`` (sync or aio); anything else unchanged."""
    if isinstance(err, IdemregError) or not isinstance(err, grpc.RpcError):
        return err
    rpc: BaseException = err
    code_fn = getattr(err, "code", None)
    if code_fn is None:
        return rpc
    code: grpc.StatusCode = code_fn()
    message = err.details() if hasattr(err, "details") else ""
    details: list[Any] = []
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for k, v in trailing or ():
        if k == _STATUS_DETAILS_KEY and isinstance(v, bytes):
            try:
                st = status_pb2.Status.FromString(v)
            except Exception:  # a status we cannot read types by its code alone
                break
            details = list(st.details)
            message = st.message or message
            break
    typed: BaseException = _typed(code, message or "", details)
    typed.__cause__ = err
    return typed


def _typed(code: grpc.StatusCode, message: str, details: Any) -> IdemregError:
    reason = ""
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    retry_after = 0.0
    for any_ in details:
        name = any_.type_url[len(_TYPE_PREFIX):] if any_.type_url.startswith(_TYPE_PREFIX) else any_.type_url
        if name == "google.rpc.ErrorInfo":
            info = error_details_pb2.ErrorInfo.FromString(any_.value)
            if info.domain in (ERROR_DOMAIN, _LEGACY_ERROR_DOMAIN):
                reason, metadata = info.reason, dict(info.metadata)
        elif name == "google.rpc.RetryInfo":
            ri = error_details_pb2.RetryInfo.FromString(any_.value)
            retry_after = ri.retry_delay.seconds + ri.retry_delay.nanos / 1e9
        elif name == "google.rpc.BadRequest":
            br = error_details_pb2.BadRequest.FromString(any_.value)
            violations.extend(FieldViolation(v.field, v.description) for v in br.field_violations)
    cls = _BY_REASON.get(reason, IdemregError) if reason else _BY_CODE.get(code, IdemregError)
    return cls(message, code=code, reason=reason, metadata=metadata, field_violations=violations, retry_after=retry_after)


class FinalError(Exception):
    """A final failure: ``once`` stores it and replays it to every duplicate
    instead of releasing the key for a retry. Use it for an outcome no retry
    can change, such as a declined card. ``code`` is stored with the message
    (UNKNOWN by default, as the Go client stores a plain error)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class StoredFailureError(FinalError):
    """A final failure replayed from the registry: ``once`` raises it for a key
    whose handler failed finally before. It is final too (:func:`is_final`)."""


def final(err: Union[BaseException, str], code: Optional[grpc.StatusCode] = None) -> FinalError:
    """Marks ``err`` final; raise what it returns. An :class:`IdemregError`
    keeps its code unless ``code`` is given."""
    if isinstance(err, FinalError) and code is None:
        return err
    if isinstance(err, str):
        return FinalError(err, code or grpc.StatusCode.UNKNOWN)
    if code is None:
        code = err.code if isinstance(err, IdemregError) else grpc.StatusCode.UNKNOWN
    message = err.message if isinstance(err, IdemregError) else str(err)
    f = FinalError(message, code)
    f.__cause__ = err
    return f


def is_final(err: BaseException) -> bool:
    """Whether err is final: a consumer acknowledges its message exactly when
    ``once`` returned or raised an error for which this is true."""
    return isinstance(err, FinalError)


class OutcomeNotRecordedError(Exception):
    """The handler ran (``ran`` is true) but its outcome could not be stored:
    the registry was unreachable for the whole bookkeeping timeout, or
    another holder took over. ``__cause__`` says why; ``value`` is what the
    handler returned (None after a final failure)."""

    def __init__(self, message: str, value: Any = None) -> None:
        super().__init__(message)
        self.ran = True
        self.value = value
