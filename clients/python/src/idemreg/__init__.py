"""idemreg: the idempotency-key registry's Python client.

:class:`Client` (grpc) and :class:`AsyncClient` (grpc.aio) make the
registry's calls with typed errors (:mod:`idemreg.errors`), and ``once``
runs a handler at most once to completion per key with the Go client's
``Once`` semantics. ``idemreg.v1`` is the generated API.
"""

from idemreg._core import (
    KIND_MESSAGE,
    KIND_OPERATION,
    Attempt,
    Claim,
    ClaimParams,
    CompleteParams,
    Fence,
    Key,
    OnceResult,
    failure_result,
    new_request_id,
    response_result,
)
from idemreg.aio import AsyncClient
from idemreg.client import Client, current_attempt
from idemreg.codec import BYTES, JSON, BytesCodec, Codec, JSONCodec
from idemreg.credentials import bearer_token, channel_credentials
from idemreg.errors import (
    ERROR_DOMAIN,
    AlreadyCompletedError,
    CanceledError,
    CapacityExhaustedError,
    ClaimSecretInvalidError,
    DeadlineExceededError,
    FieldViolation,
    FinalError,
    FingerprintMismatchError,
    IdemregError,
    InProgressError,
    InternalError,
    InvalidArgumentError,
    KeyUnsupportedError,
    LeaseLostError,
    LeaseTotalExceededError,
    MissingKeyError,
    NotFoundError,
    OutcomeNotRecordedError,
    ParkedError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitedError,
    StoredFailureError,
    StoredResultUnreadableError,
    UnauthenticatedError,
    UnavailableError,
    final,
    from_rpc_error,
    from_status,
    is_final,
)
from idemreg.fingerprint import default_fingerprint
from idemreg.v1.registry_pb2 import (
    OUTCOME_ACQUIRED,
    OUTCOME_COMPLETED,
    OUTCOME_IN_PROGRESS,
    OUTCOME_PARKED,
    Record,
)

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_")]
