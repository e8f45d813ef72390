// Package reason classifies the errors a request meets and builds the
// statuses it is answered with.
//
// Every error the server answers (the store's sentinels, the context's, and
// the refusals of the server's own mechanisms) has one reason, an
// idemreg.v1.ErrorReason, which fixes the status code (ErrorReason.Code) and
// the ErrorInfo.reason. Classify is that one classification: the status
// (the server's toStatus), the store's metrics, readiness and the admin
// audit all go by it, so that they cannot disagree about what an error is.
// The mechanisms below the handlers (quotas, claim secrets, the store
// chain's bounds) declare their errors' reasons themselves (Reasoned), so
// that this package imports none of them and each can classify.
//
// Status builds every status the server sends: its message and metadata
// cut to the bounds of Echo and Bounded, the ErrorInfo first, then the
// details a reason carries (BadRequest, QuotaFailure, RetryInfo).
package reason

import (
	"context"
	"errors"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage"
)

// Reasoned is an error that says which reason it is answered with: the
// refusals of the server's own mechanisms.
type Reasoned interface {
	error
	Reason() idemregv1.ErrorReason
}

// Classify is the reason err is answered with, ERROR_REASON_UNSPECIFIED for
// nil and INTERNAL for an error nobody classified.
func Classify(err error) idemregv1.ErrorReason {
	var reasoned Reasoned
	switch {
	case err == nil:
		return idemregv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	case errors.As(err, &reasoned):
		return reasoned.Reason()
	case errors.Is(err, storage.ErrLeaseTotalExceeded):
		return idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED
	case errors.Is(err, storage.ErrFingerprintMismatch):
		return idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH
	case errors.Is(err, storage.ErrLeaseLost):
		return idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST
	case errors.Is(err, storage.ErrAlreadyCompleted):
		return idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED
	case errors.Is(err, storage.ErrParked):
		return idemregv1.ErrorReason_ERROR_REASON_PARKED
	case errors.Is(err, storage.ErrNotFound):
		return idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND
	case errors.Is(err, context.DeadlineExceeded):
		return idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED
	case errors.Is(err, context.Canceled):
		return idemregv1.ErrorReason_ERROR_REASON_CANCELED
	case errors.Is(err, storage.ErrExhausted):
		// Before ErrUnavailable: an exhaustion is not an outage, and
		// the caller is told which resource ran short.
		return idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED
	case errors.Is(err, storage.ErrUnavailable):
		return idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE
	default:
		return idemregv1.ErrorReason_ERROR_REASON_INTERNAL
	}
}

// IsAnswer reports whether r is one of the registry's answers (the store,
// or the quota before it, decided the call) rather than a failure.
func IsAnswer(r idemregv1.ErrorReason) bool {
	switch r {
	case idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH, idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST,
		idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED, idemregv1.ErrorReason_ERROR_REASON_PARKED,
		idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED, idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED,
		idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND, idemregv1.ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID:
		return true
	}
	return false
}

// Answer is the reason the caller of a request (ctx) is answered with for
// err: Classify's, but for a deadline that ran out while the request still
// runs. That is the store's share of the request's time running out, so
// the caller, who still waits, is told the store did not answer:
// STORE_UNAVAILABLE, with a RetryInfo, rather than a DEADLINE_EXCEEDED it
// did not cause.
func Answer(ctx context.Context, err error) idemregv1.ErrorReason {
	r := Classify(err)
	if r == idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED && ctx.Err() == nil {
		return idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE
	}
	return r
}

// Status is the status of a refusal for reason r: the code is the reason's
// (ErrorReason.Code), so that a reason never comes with another. Its
// message and metadata values are cut to the bounds of Echo and Bounded,
// once, here, so that no caller can make a status larger than they are, or
// one that does not encode, whatever it quotes.
func Status(r idemregv1.ErrorReason, msg string, meta map[string]string, extra ...protoadapt.MessageV1) error {
	for k, v := range meta {
		meta[k] = Echo(v)
	}
	st := status.New(r.Code(), Bounded(msg, MaxStatusMessageBytes))
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: r.Reason(), Domain: idemregv1.ErrorDomain, Metadata: meta}}, extra...)
	withDetails, err := st.WithDetails(details...)
	if err != nil {
		// A detail that does not encode (a text not bounded above): the
		// ErrorInfo is what clients decide by, so it goes alone rather
		// than the status going without it.
		withDetails, err = st.WithDetails(&errdetails.ErrorInfo{Reason: r.Reason(), Domain: idemregv1.ErrorDomain})
	}
	if err == nil {
		st = withDetails
	}
	return st.Err()
}

// RetryInfo suggests a delay before retrying, at least a millisecond.
func RetryInfo(d time.Duration) *errdetails.RetryInfo {
	return &errdetails.RetryInfo{RetryDelay: durationpb.New(max(d, time.Millisecond).Round(time.Millisecond))}
}
