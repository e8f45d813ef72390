package idemregv1

import (
	"strings"

	"google.golang.org/grpc/codes"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every error of the
// registry, whose reason is one of ErrorReason's (error_reason.proto says
// the code and the meaning of each), and of the Go client's interceptors.
// Declared here, beside the API, so that the server and its clients share
// them; server and client re-export them.
//
// It is a service name, globally unique as AIP-193 asks; registries before
// it sent "idemreg", which the Go client still accepts for a release.
const ErrorDomain = "idemreg.dev"

// reasonPrefix is what the names of ErrorReason's values have and the
// reasons sent in ErrorInfo.reason have not.
const reasonPrefix = "ERROR_REASON_"

// Reason is the ErrorInfo.reason that carries r: its name without the
// ERROR_REASON_ prefix ("LEASE_LOST" for ERROR_REASON_LEASE_LOST). It is ""
// for ERROR_REASON_UNSPECIFIED and for a value this version of the API does
// not know. The Reason* constants (reasons_gen.go) are generated from it.
func (r ErrorReason) Reason() string {
	if r == ErrorReason_ERROR_REASON_UNSPECIFIED {
		return ""
	}
	return strings.TrimPrefix(ErrorReason_name[int32(r)], reasonPrefix)
}

// ParseReason returns the ErrorReason whose Reason is reason, or
// ERROR_REASON_UNSPECIFIED when this version of the API knows none (a
// newer server's, or an empty one).
func ParseReason(reason string) ErrorReason {
	if reason == "" {
		return ErrorReason_ERROR_REASON_UNSPECIFIED
	}
	return ErrorReason(ErrorReason_value[reasonPrefix+reason])
}

// Code is the status code that carries r, the one error_reason.proto names
// for it (TestReasonsAreDocumented holds the two together); codes.Unknown
// for ERROR_REASON_UNSPECIFIED and values this version does not know.
func (r ErrorReason) Code() codes.Code {
	switch r {
	case ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH, ErrorReason_ERROR_REASON_LEASE_LOST,
		ErrorReason_ERROR_REASON_ALREADY_COMPLETED, ErrorReason_ERROR_REASON_PARKED,
		ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED, ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID,
		ErrorReason_ERROR_REASON_BACKUP_UNSUPPORTED:
		return codes.FailedPrecondition
	case ErrorReason_ERROR_REASON_QUOTA_EXCEEDED, ErrorReason_ERROR_REASON_RATE_LIMITED,
		ErrorReason_ERROR_REASON_TOO_MANY_CALLS, ErrorReason_ERROR_REASON_TOO_MANY_STREAMS,
		ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED:
		return codes.ResourceExhausted
	case ErrorReason_ERROR_REASON_NOT_FOUND:
		return codes.NotFound
	case ErrorReason_ERROR_REASON_INVALID_ARGUMENT, ErrorReason_ERROR_REASON_MALFORMED_REQUEST:
		return codes.InvalidArgument
	case ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, ErrorReason_ERROR_REASON_OVERLOADED:
		return codes.Unavailable
	case ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED:
		return codes.DeadlineExceeded
	case ErrorReason_ERROR_REASON_CANCELED:
		return codes.Canceled
	case ErrorReason_ERROR_REASON_INTERNAL:
		return codes.Internal
	case ErrorReason_ERROR_REASON_UNAUTHENTICATED:
		return codes.Unauthenticated
	case ErrorReason_ERROR_REASON_PERMISSION_DENIED:
		return codes.PermissionDenied
	}
	return codes.Unknown
}
