package idemregv1

// The google.rpc.ErrorInfo of every registry error: this domain, and one of
// these reasons, the names of ErrorReason's values without their prefix
// (error_reason.proto says the code and the meaning of each). Declared
// here, beside the API, so that the server and its clients share one list;
// server and client re-export them.
const ErrorDomain = "idemreg"

// Reasons carried in ErrorInfo.Reason.
const (
	ReasonInvalidArgument     = "INVALID_ARGUMENT"
	ReasonMalformedRequest    = "MALFORMED_REQUEST"
	ReasonFingerprintMismatch = "FINGERPRINT_MISMATCH"
	ReasonLeaseLost           = "LEASE_LOST"
	ReasonAlreadyCompleted    = "ALREADY_COMPLETED"
	ReasonParked              = "PARKED"
	ReasonLeaseTotalExceeded  = "LEASE_TOTAL_EXCEEDED"
	ReasonQuotaExceeded       = "QUOTA_EXCEEDED"
	ReasonNotFound            = "NOT_FOUND"
	ReasonStoreUnavailable    = "STORE_UNAVAILABLE"
	ReasonDeadlineExceeded    = "DEADLINE_EXCEEDED"
	ReasonCanceled            = "CANCELED"
	ReasonInternal            = "INTERNAL"
	ReasonUnauthenticated     = "UNAUTHENTICATED"
	ReasonPermissionDenied    = "PERMISSION_DENIED"
	ReasonRateLimited         = "RATE_LIMITED"
	ReasonOverloaded          = "OVERLOADED"
	ReasonTooManyCalls        = "TOO_MANY_CALLS"
	ReasonTooManyStreams      = "TOO_MANY_STREAMS"
)

// Reasons lists every reason above, for tests and documentation checks.
var Reasons = []string{
	ReasonInvalidArgument, ReasonMalformedRequest, ReasonFingerprintMismatch, ReasonLeaseLost,
	ReasonAlreadyCompleted, ReasonParked, ReasonLeaseTotalExceeded, ReasonQuotaExceeded,
	ReasonNotFound, ReasonStoreUnavailable, ReasonDeadlineExceeded, ReasonCanceled, ReasonInternal,
	ReasonUnauthenticated, ReasonPermissionDenied, ReasonRateLimited, ReasonOverloaded,
	ReasonTooManyCalls, ReasonTooManyStreams,
}
