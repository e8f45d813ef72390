package client

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every idemreg error,
// the registry's and the interceptors'.
const ErrorDomain = idemregv1.ErrorDomain

// legacyErrorDomain is the domain registries and interceptors sent before
// ErrorDomain became a service name (AIP-193), accepted for one release so
// that this client types the errors of a registry not yet upgraded. Remove
// it, and TestErrorDomains' case for it, in the release after the one that
// first sends ErrorDomain.
const legacyErrorDomain = "idemreg"

// Reasons carried in ErrorInfo.Reason. The registry's are the strings of
// the API's ErrorReason (idemregv1, generated from it; error_reason.proto
// documents each); the interceptors add their own, which are not.
const (
	ReasonInvalidArgument     = idemregv1.ReasonInvalidArgument
	ReasonFingerprintMismatch = idemregv1.ReasonFingerprintMismatch
	ReasonLeaseLost           = idemregv1.ReasonLeaseLost
	// ReasonClaimSecretInvalid (code FAILED_PRECONDITION): the claim secret
	// sent with the token verifies under no claim key the registry accepts
	// (not the one its Claim returned, or one whose key was retired after a
	// rotation's grace period).
	ReasonClaimSecretInvalid = idemregv1.ReasonClaimSecretInvalid
	ReasonAlreadyCompleted   = idemregv1.ReasonAlreadyCompleted
	// ReasonParked (code FAILED_PRECONDITION): Complete, Release or Extend
	// of a parked record. Once and the interceptors also answer it, as a
	// *ParkedError, for a Claim that answered OutcomeParked.
	ReasonParked = idemregv1.ReasonParked
	// ReasonLeaseTotalExceeded (code FAILED_PRECONDITION): an Extend would
	// hold the key past the consumer's max_lease_total since the attempt
	// began; the metadata's lease_not_after is the latest a lease may end.
	ReasonLeaseTotalExceeded = idemregv1.ReasonLeaseTotalExceeded
	// ReasonQuotaExceeded (code RESOURCE_EXHAUSTED, with QuotaFailure): a
	// Claim of a new key for a consumer at its max_records or max_bytes;
	// Claims of its live keys still work.
	ReasonQuotaExceeded    = idemregv1.ReasonQuotaExceeded
	ReasonNotFound         = idemregv1.ReasonNotFound
	ReasonStoreUnavailable = idemregv1.ReasonStoreUnavailable
	ReasonDeadlineExceeded = idemregv1.ReasonDeadlineExceeded
	ReasonCanceled         = idemregv1.ReasonCanceled
	ReasonInternal         = idemregv1.ReasonInternal
	ReasonUnauthenticated  = idemregv1.ReasonUnauthenticated
	ReasonPermissionDenied = idemregv1.ReasonPermissionDenied
	// ReasonRateLimited (code RESOURCE_EXHAUSTED, with QuotaFailure and
	// RetryInfo): the consumer's or the identity's rate limit was reached.
	ReasonRateLimited = idemregv1.ReasonRateLimited
	// ReasonTooManyCalls (code RESOURCE_EXHAUSTED, with QuotaFailure and
	// RetryInfo): the caller's identity has as many calls in progress as
	// the registry allows one identity; it matches ErrRateLimited.
	ReasonTooManyCalls = idemregv1.ReasonTooManyCalls
	// ReasonOverloaded (code UNAVAILABLE, with RetryInfo): the registry has
	// too many store operations in flight; it returns an *UnavailableError.
	ReasonOverloaded = idemregv1.ReasonOverloaded
	// ReasonMalformedRequest (code INVALID_ARGUMENT): the request did not
	// decode as its protobuf message; it returns ErrInvalidArgument.
	ReasonMalformedRequest = idemregv1.ReasonMalformedRequest
	// ReasonCapacityExhausted (code RESOURCE_EXHAUSTED, with RetryInfo and
	// metadata resource: disk, memory, connections, file_descriptors):
	// the registry or its store is short of a resource; Claims that would
	// start work are refused while Completes, Releases and Extends of held
	// keys go on. It returns ErrCapacityExhausted.
	ReasonCapacityExhausted = idemregv1.ReasonCapacityExhausted

	// ReasonInProgress (code ABORTED, with RetryInfo) is the interceptors'
	// answer to a duplicate that arrives while the first call still runs.
	ReasonInProgress = "IN_PROGRESS"
	// ReasonMissingKey (code INVALID_ARGUMENT) is the interceptors' answer to
	// a selected call without an idempotency key when the policy requires one.
	ReasonMissingKey = "IDEMPOTENCY_KEY_MISSING"
	// ReasonRegistryUnavailable (code UNAVAILABLE, with RetryInfo) is the
	// interceptors' answer when they cannot reach the registry and fail
	// closed: the call was not run (UnavailableError.NotRun).
	ReasonRegistryUnavailable = "REGISTRY_UNAVAILABLE"
	// ReasonKeyUnsupported (code INVALID_ARGUMENT, with BadRequest on
	// idempotency-key) is the stream interceptors' answer to a streaming
	// call that carries an idempotency key: streams are not de-duplicated,
	// so the call is refused rather than run again for every retry.
	ReasonKeyUnsupported = "IDEMPOTENCY_KEY_UNSUPPORTED"
	// ReasonStoredResultUnreadable (code INTERNAL) is the interceptors'
	// answer when the key's stored reply does not decode as the call's
	// reply type: the call is not run again; an operator repairs the
	// record (docs/operations.md).
	ReasonStoredResultUnreadable = "STORED_RESULT_UNREADABLE"
)

// Sentinels for errors.Is. Every error of the typed client, Once and the
// interceptors that comes from the registry matches exactly one of them (or
// none, for a status that is not the registry's, such as UNIMPLEMENTED from
// a wrong address).
var (
	ErrInvalidArgument     = errors.New("idemreg: invalid argument")
	ErrFingerprintMismatch = errors.New("idemreg: fingerprint mismatch: the key was used with different parameters")
	ErrLeaseLost           = errors.New("idemreg: lease lost: another holder took over the key")
	// ErrClaimSecretInvalid: the registry accepts the claim secret for the
	// token under none of its claim keys. The claim cannot be completed,
	// released or extended with it; a claim held past a key rotation's
	// grace period ends this way. The registry read and changed nothing.
	ErrClaimSecretInvalid = errors.New("idemreg: the claim secret is not valid for the token under any claim key the registry accepts")
	ErrAlreadyCompleted   = errors.New("idemreg: the key is already completed")
	// ErrParked: the key is parked (its attempts ran out, or its holder
	// parked it because the outcome of its work is unknown): do not do the
	// work; dead-letter or skip the message until an operator resolves it.
	// For a Claim it is a *ParkedError carrying the record.
	ErrParked = errors.New("idemreg: the key is parked")
	// ErrLeaseTotalExceeded: the Extend asked for more than is left of the
	// consumer's max_lease_total for this attempt; the lease in force is
	// unchanged, so finish (or Release) before it ends.
	ErrLeaseTotalExceeded = errors.New("idemreg: the lease would run past the most one attempt may hold the key")
	// ErrQuotaExceeded: the consumer is at its quota of live records or
	// bytes, so the registry takes no new key for it until some of its
	// records expire; retrying soon does not help.
	ErrQuotaExceeded = errors.New("idemreg: the consumer is at its quota of records")
	ErrNotFound      = errors.New("idemreg: no live record for the key")
	// ErrCapacityExhausted: the registry or its store is short of disk,
	// memory, connections or file descriptors (the *Error's
	// Metadata["resource"] says which) and refused the call; finish the
	// keys you hold, and retry new ones after RetryAfter.
	ErrCapacityExhausted = errors.New("idemreg: the registry is short of capacity")
	// ErrUnavailable: the registry or its store cannot answer now. The error
	// is an *UnavailableError carrying the suggested retry delay.
	ErrUnavailable      = errors.New("idemreg: registry unavailable")
	ErrDeadlineExceeded = errors.New("idemreg: deadline exceeded")
	ErrCanceled         = errors.New("idemreg: canceled")
	ErrInternal         = errors.New("idemreg: internal error")
	// ErrUnauthenticated: the call carried no credentials the registry
	// accepts.
	ErrUnauthenticated = errors.New("idemreg: unauthenticated")
	// ErrPermissionDenied: the caller's identity may not use the consumer.
	ErrPermissionDenied = errors.New("idemreg: permission denied for the consumer")
	// ErrRateLimited: the consumer's rate limit, or the identity's bound on
	// calls in progress, was reached; the *Error's RetryAfter says when to
	// try again.
	ErrRateLimited = errors.New("idemreg: rate limited")

	// ErrInProgress: another holder is working on the key. The error is an
	// *InProgressError carrying the time left on its lease.
	ErrInProgress = errors.New("idemreg: the key is in progress elsewhere")
	// ErrMissingKey: a selected call carried no idempotency key.
	ErrMissingKey = errors.New("idemreg: no idempotency key")
	// ErrKeyUnsupported: a streaming call carried an idempotency key, which
	// streams cannot honour; it was not run.
	ErrKeyUnsupported = errors.New("idemreg: idempotency keys are not supported on streaming calls")
	// ErrStoredResultUnreadable: the key is completed, but its stored reply
	// does not decode as the call's reply; the call was not run again. The
	// *Error's Metadata names the record (consumer, kind, key, type).
	ErrStoredResultUnreadable = errors.New("idemreg: the stored result does not decode")
)

var sentinelByReason = map[string]error{
	ReasonInvalidArgument:     ErrInvalidArgument,
	ReasonMalformedRequest:    ErrInvalidArgument,
	ReasonFingerprintMismatch: ErrFingerprintMismatch,
	ReasonLeaseLost:           ErrLeaseLost,
	ReasonClaimSecretInvalid:  ErrClaimSecretInvalid,
	ReasonAlreadyCompleted:    ErrAlreadyCompleted,
	ReasonParked:              ErrParked,
	ReasonLeaseTotalExceeded:  ErrLeaseTotalExceeded,
	ReasonQuotaExceeded:       ErrQuotaExceeded,
	ReasonNotFound:            ErrNotFound,
	ReasonStoreUnavailable:    ErrUnavailable,
	ReasonRegistryUnavailable: ErrUnavailable,
	ReasonDeadlineExceeded:    ErrDeadlineExceeded,
	ReasonCanceled:            ErrCanceled,
	ReasonInternal:            ErrInternal,
	ReasonUnauthenticated:     ErrUnauthenticated,
	ReasonPermissionDenied:    ErrPermissionDenied,
	ReasonRateLimited:         ErrRateLimited,
	ReasonTooManyCalls:        ErrRateLimited,
	ReasonOverloaded:          ErrUnavailable,
	ReasonCapacityExhausted:   ErrCapacityExhausted,
	ReasonInProgress:          ErrInProgress,
	ReasonMissingKey:          ErrMissingKey,
	ReasonKeyUnsupported:      ErrKeyUnsupported,

	ReasonStoredResultUnreadable: ErrStoredResultUnreadable,
}

// Statuses without an idemreg ErrorInfo come from the transport: the
// registry is down, or the caller's own deadline or cancellation hit first.
var sentinelByCode = map[codes.Code]error{
	codes.Unavailable:      ErrUnavailable,
	codes.DeadlineExceeded: ErrDeadlineExceeded,
	codes.Canceled:         ErrCanceled,
}

// Error is an error status of the registry (or of the interceptors), with
// its details decoded. It unwraps to one of the Err* sentinels, and a
// deadline or cancellation also matches context.DeadlineExceeded or
// context.Canceled. GRPCStatus returns the original status, so status.Code
// and status.Convert keep working on it.
type Error struct {
	Code codes.Code
	// Reason is the ErrorInfo reason, empty when the status carried none
	// (a transport error such as a refused connection).
	Reason  string
	Message string
	// Metadata is the ErrorInfo metadata, such as consumer, kind and key.
	Metadata map[string]string
	// FieldViolations lists the invalid fields of an INVALID_ARGUMENT.
	FieldViolations []FieldViolation
	// RetryAfter is the status's RetryInfo delay (RATE_LIMITED carries one),
	// zero when it had none.
	RetryAfter time.Duration

	sentinel error
	st       *status.Status
}

// FieldViolation is one invalid field of a request.
type FieldViolation struct {
	Field, Description string
}

func (e *Error) Error() string {
	label := e.Reason
	if label == "" {
		label = e.Code.String()
	}
	return fmt.Sprintf("idemreg: %s: %s", label, e.Message)
}

// Unwrap returns the sentinel the error matches, if any.
func (e *Error) Unwrap() error { return e.sentinel }

// Is matches context.DeadlineExceeded and context.Canceled for deadline and
// cancellation statuses, besides the sentinel.
func (e *Error) Is(target error) bool {
	switch target {
	case context.DeadlineExceeded:
		return e.Code == codes.DeadlineExceeded
	case context.Canceled:
		return e.Code == codes.Canceled
	}
	return false
}

// GRPCStatus returns the status the error was built from.
func (e *Error) GRPCStatus() *status.Status { return e.st }

// UnavailableError says the registry (or its store) could not answer. Retry
// after RetryAfter; it is zero when the status suggested no delay, as when
// the connection itself failed. It unwraps to the *Error and so to
// ErrUnavailable.
type UnavailableError struct {
	RetryAfter time.Duration
	// NotRun is true when the error is an interceptor's answer (reason
	// REGISTRY_UNAVAILABLE, from either side of the call): it could not
	// reach the registry, so it did not call the downstream or run the
	// handler, and the call can be retried as it is.
	NotRun bool
	Err    *Error
	// Cause is the registry call's own error when this client's
	// interceptor answered; nil in an error rebuilt from a status.
	Cause error
}

func (e *UnavailableError) Error() string { return e.Err.Error() }

// Unwrap returns the underlying *Error, and the cause when there is one.
func (e *UnavailableError) Unwrap() []error {
	if e.Cause != nil {
		return []error{e.Err, e.Cause}
	}
	return []error{e.Err}
}

// GRPCStatus returns the status the error was built from.
func (e *UnavailableError) GRPCStatus() *status.Status { return e.Err.GRPCStatus() }

// InProgressError says another holder has a live claim on the key: the
// work may be running now. Retry after RetryAfter: how long the work of
// the key's consumer took on average when this client ran it (or
// DefaultInProgressRetry before it ran any), at least MinInProgressRetry
// and at most the time left on the holder's lease, by when the key can be
// taken over. Its status is ABORTED with a RetryInfo, which is what the
// interceptors return to their callers.
type InProgressError struct {
	RetryAfter time.Duration
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("idemreg: %s: the key is in progress elsewhere; retry after %v", ReasonInProgress, e.RetryAfter)
}

// Is matches ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// GRPCStatus is ABORTED with ErrorInfo reason IN_PROGRESS and a RetryInfo.
func (e *InProgressError) GRPCStatus() *status.Status {
	return newStatus(codes.Aborted, ReasonInProgress,
		"a request with this idempotency key is in progress; retry after the delay in RetryInfo",
		&errdetails.RetryInfo{RetryDelay: durationpb.New(e.RetryAfter)})
}

// ParkedError says a Claim found the key parked (Claim.Outcome is
// OutcomeParked): the work must not be done. Once, OnceBatch and the
// interceptors return it without running the handler. It matches
// ErrParked; its status is FAILED_PRECONDITION with reason PARKED, which
// is what the interceptors return to their callers. It is not final
// (IsFinal is false): a consumer dead-letters or skips the message rather
// than acknowledging it as done.
type ParkedError struct {
	// Record is the parked record; Record.ParkReason says why.
	Record Record
}

func (e *ParkedError) Error() string {
	return fmt.Sprintf("idemreg: %s: the key is parked (%s); do not do the work", ReasonParked, e.Record.ParkReason)
}

// Is matches ErrParked.
func (e *ParkedError) Is(target error) bool { return target == ErrParked }

// GRPCStatus is FAILED_PRECONDITION with ErrorInfo reason PARKED.
func (e *ParkedError) GRPCStatus() *status.Status {
	return newStatus(codes.FailedPrecondition, ReasonParked,
		"the idempotency key is parked: the request must not be run until an operator resolves it")
}

func newStatus(code codes.Code, reason, msg string, extra ...protoadapt.MessageV1) *status.Status {
	st := status.New(code, msg)
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}}, extra...)
	if withDetails, err := st.WithDetails(details...); err == nil {
		return withDetails
	}
	return st
}

// FromError rebuilds the typed error of a status error: an *Error, an
// *UnavailableError, an *InProgressError or a *ParkedError (its record
// is not in the status: use errors.Is(err, ErrParked)). Errors the typed client, Once
// and the interceptors return are converted already; use FromError on an
// error from a service that uses UnaryServerInterceptor, to match its
// IN_PROGRESS and FINGERPRINT_MISMATCH answers with errors.Is. An error that
// carries no status is returned unchanged, and nil stays nil.
func FromError(err error) error {
	if err == nil {
		return nil
	}
	var (
		e  *Error
		ue *UnavailableError
		ie *InProgressError
		pe *ParkedError
	)
	if errors.As(err, &e) || errors.As(err, &ue) || errors.As(err, &ie) || errors.As(err, &pe) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	return FromStatus(st)
}

// FromStatus rebuilds the typed error of a status; nil for OK.
func FromStatus(st *status.Status) error {
	if st.Code() == codes.OK {
		return nil
	}
	e := &Error{Code: st.Code(), Message: st.Message(), st: st}
	var retryAfter time.Duration
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			if domain := d.GetDomain(); domain == ErrorDomain || domain == legacyErrorDomain {
				e.Reason, e.Metadata = d.GetReason(), d.GetMetadata()
			}
		case *errdetails.RetryInfo:
			retryAfter = d.GetRetryDelay().AsDuration()
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				e.FieldViolations = append(e.FieldViolations, FieldViolation{Field: v.GetField(), Description: v.GetDescription()})
			}
		}
	}
	e.RetryAfter = retryAfter
	if e.Reason != "" {
		e.sentinel = sentinelByReason[e.Reason]
	} else {
		e.sentinel = sentinelByCode[e.Code]
	}
	switch e.sentinel {
	case ErrUnavailable:
		return &UnavailableError{RetryAfter: retryAfter, Err: e, NotRun: e.Reason == ReasonRegistryUnavailable}
	case ErrInProgress:
		return &InProgressError{RetryAfter: retryAfter}
	}
	return e
}

// Final marks err as a final failure: Once stores it and replays it to
// every duplicate instead of releasing the key for a retry. Use it for an
// outcome that no retry can change, such as a declined card or a message
// that fails validation. A gRPC status inside err is stored as it is (code,
// message, details); any other error is stored as UNKNOWN with its text.
// Final(nil) is nil.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return &finalError{err: err}
}

// IsFinal reports whether err was marked with Final. The stored failure Once
// replays to a duplicate is final too, so a consumer acknowledges a message
// exactly when err == nil || IsFinal(err).
func IsFinal(err error) bool {
	var f *finalError
	return errors.As(err, &f)
}

type finalError struct{ err error }

func (f *finalError) Error() string { return f.err.Error() }
func (f *finalError) Unwrap() error { return f.err }

// GRPCStatus keeps the wrapped status intact (status.FromError would
// otherwise rewrite its message).
func (f *finalError) GRPCStatus() *status.Status {
	if st, ok := status.FromError(f.err); ok {
		return st
	}
	return nil
}

// contextError is ctx's error as a typed status error.
func contextError(ctx context.Context) error {
	return FromStatus(status.FromContextError(ctx.Err()))
}
