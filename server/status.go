package server

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// leaseTotalExceeded is storage.ErrLeaseTotalExceeded with what the
// answer tells the holder: the bound and the latest end of a lease.
type leaseTotalExceeded struct {
	max      time.Duration
	notAfter time.Time
	source   string
}

func (e *leaseTotalExceeded) Error() string { return storage.ErrLeaseTotalExceeded.Error() }

func (e *leaseTotalExceeded) Unwrap() error { return storage.ErrLeaseTotalExceeded }

// ErrorDomain is the ErrorInfo domain of every idemreg error.
const ErrorDomain = idemregv1.ErrorDomain

// Reasons carried in ErrorInfo.Reason; the proto documents each.
const (
	ReasonInvalidArgument     = idemregv1.ReasonInvalidArgument
	ReasonFingerprintMismatch = idemregv1.ReasonFingerprintMismatch
	ReasonLeaseLost           = idemregv1.ReasonLeaseLost
	// CLAIM_SECRET_INVALID (code FAILED_PRECONDITION): the claim_secret
	// verifies under no claim key generation the server accepts.
	ReasonClaimSecretInvalid = idemregv1.ReasonClaimSecretInvalid
	ReasonAlreadyCompleted   = idemregv1.ReasonAlreadyCompleted
	// PARKED (code FAILED_PRECONDITION): Complete, Release or Extend of a
	// parked record.
	ReasonParked             = idemregv1.ReasonParked
	ReasonLeaseTotalExceeded = idemregv1.ReasonLeaseTotalExceeded
	// QUOTA_EXCEEDED (code RESOURCE_EXHAUSTED, with QuotaFailure): a Claim
	// of a new key for a consumer at its max_records or max_bytes (quota.go).
	ReasonQuotaExceeded    = idemregv1.ReasonQuotaExceeded
	ReasonNotFound         = idemregv1.ReasonNotFound
	ReasonStoreUnavailable = idemregv1.ReasonStoreUnavailable
	ReasonDeadlineExceeded = idemregv1.ReasonDeadlineExceeded
	ReasonCanceled         = idemregv1.ReasonCanceled
	ReasonInternal         = idemregv1.ReasonInternal
	// The middleware's own answers (auth.go, deadline.go, observe.go,
	// bounds.go); MALFORMED_REQUEST (code INVALID_ARGUMENT): the request is
	// not a valid protobuf encoding of its message (codec.go).
	ReasonUnauthenticated  = idemregv1.ReasonUnauthenticated
	ReasonPermissionDenied = idemregv1.ReasonPermissionDenied
	ReasonRateLimited      = idemregv1.ReasonRateLimited
	ReasonOverloaded       = idemregv1.ReasonOverloaded
	ReasonTooManyStreams   = idemregv1.ReasonTooManyStreams
	ReasonTooManyCalls     = idemregv1.ReasonTooManyCalls
	ReasonMalformedRequest = idemregv1.ReasonMalformedRequest
	// CAPACITY_EXHAUSTED (code RESOURCE_EXHAUSTED, metadata resource, with
	// RetryInfo): the store or the server is short of disk, memory,
	// connections or file descriptors (storage.ExhaustedError).
	ReasonCapacityExhausted = idemregv1.ReasonCapacityExhausted
)

// unavailableRetryAfter is the RetryInfo delay suggested when the store is
// unavailable.
const unavailableRetryAfter = time.Second

// exhaustedRetryAfter is the RetryInfo delay suggested when the store is
// short of a resource: a disk fills and frees over minutes (the sweeper,
// compactions, an operator), so retrying at once only adds load.
// connectionsRetryAfter is the delay for the database's connections,
// which free up in seconds.
const (
	exhaustedRetryAfter   = 30 * time.Second
	connectionsRetryAfter = 2 * time.Second
)

// overloadedRetryAfter is the RetryInfo delay suggested when the store has
// the most operations in flight: short, since the slots free up quickly.
const overloadedRetryAfter = 100 * time.Millisecond

// newStatus builds the status of a refusal: the code is the reason's
// (ErrorReason.Code), so that a reason never comes with another. Its message
// and metadata values are cut to the bounds of echo.go and escaped here,
// once, so that no caller can make a status larger than they are, or one
// that does not encode, whatever it quotes.
func newStatus(reason idemregv1.ErrorReason, msg string, meta map[string]string, extra ...protoadapt.MessageV1) error {
	for k, v := range meta {
		meta[k] = echo(v)
	}
	st := status.New(reason.Code(), bounded(msg, MaxStatusMessageBytes))
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason.Reason(), Domain: ErrorDomain, Metadata: meta}}, extra...)
	withDetails, err := st.WithDetails(details...)
	if err != nil {
		// A detail that does not encode (a text not bounded above): the
		// ErrorInfo is what clients decide by, so it goes alone rather
		// than the status going without it.
		withDetails, err = st.WithDetails(&errdetails.ErrorInfo{Reason: reason.Reason(), Domain: ErrorDomain})
	}
	if err == nil {
		st = withDetails
	}
	return st.Err()
}

func invalidArgument(v violations) error {
	return newStatus(idemregv1.ErrorReason_ERROR_REASON_INVALID_ARGUMENT, "invalid request: "+v[0].Field+": "+v[0].Description,
		nil, &errdetails.BadRequest{FieldViolations: v})
}

func keyMeta(k storage.Key) map[string]string {
	return map[string]string{"consumer": k.Consumer, "kind": kindName(k.Kind), "key": k.Key}
}

// The reasons the service meets its errors with, by their enum names.
const (
	reasonFingerprintMismatch = idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH
	reasonLeaseLost           = idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST
	reasonClaimSecretInvalid  = idemregv1.ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID
	reasonAlreadyCompleted    = idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED
	reasonParked              = idemregv1.ErrorReason_ERROR_REASON_PARKED
	reasonLeaseTotalExceeded  = idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED
	reasonQuotaExceeded       = idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED
	reasonNotFound            = idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND
	reasonStoreUnavailable    = idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE
	reasonDeadlineExceeded    = idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED
	reasonCanceled            = idemregv1.ErrorReason_ERROR_REASON_CANCELED
	reasonOverloaded          = idemregv1.ErrorReason_ERROR_REASON_OVERLOADED
	reasonCapacityExhausted   = idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED
	reasonInternal            = idemregv1.ErrorReason_ERROR_REASON_INTERNAL
)

// classify is the one classification of the errors the service meets
// (the store's sentinels, the context's errors, the server's own
// refusals): the reason each is answered with, ERROR_REASON_UNSPECIFIED for
// nil. The status (toStatus), the store's metrics (storeErrorType, the
// claim outcomes), readiness (callOutcomes.record) and the admin audit all
// go by it, so that they cannot disagree about what an error is.
func classify(err error) idemregv1.ErrorReason {
	var exceeded *quota.Exceeded
	switch {
	case err == nil:
		return idemregv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	case errors.As(err, &exceeded):
		return reasonQuotaExceeded
	case errors.Is(err, storage.ErrLeaseTotalExceeded):
		return reasonLeaseTotalExceeded
	case errors.Is(err, storage.ErrFingerprintMismatch):
		return reasonFingerprintMismatch
	case errors.Is(err, storage.ErrLeaseLost):
		return reasonLeaseLost
	case errors.Is(err, claimsecret.ErrUnknown):
		return reasonClaimSecretInvalid
	case errors.Is(err, storage.ErrAlreadyCompleted):
		return reasonAlreadyCompleted
	case errors.Is(err, storage.ErrParked):
		return reasonParked
	case errors.Is(err, storage.ErrNotFound):
		return reasonNotFound
	case errors.Is(err, context.DeadlineExceeded):
		return reasonDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return reasonCanceled
	case errors.Is(err, errOverloaded): // shareExceeded too
		return reasonOverloaded
	case errors.Is(err, storage.ErrExhausted):
		// Before ErrUnavailable: an exhaustion is not an outage, and
		// the caller is told which resource ran short.
		return reasonCapacityExhausted
	case errors.Is(err, storage.ErrUnavailable):
		return reasonStoreUnavailable
	default:
		return reasonInternal
	}
}

// isAnswer reports whether reason is one of the registry's answers (the
// store, or the quota before it, decided the call) rather than a failure.
func isAnswer(reason idemregv1.ErrorReason) bool {
	switch reason {
	case reasonFingerprintMismatch, reasonLeaseLost, reasonAlreadyCompleted, reasonParked,
		reasonLeaseTotalExceeded, reasonQuotaExceeded, reasonNotFound, reasonClaimSecretInvalid:
		return true
	}
	return false
}

// answerReason is the reason the caller of a request (ctx) is answered
// with for err: classify's, but for a deadline that ran out while the
// request still runs. That is the store's share of the request's time
// (storeContext) running out, so the caller, who still waits, is told
// the store did not answer: STORE_UNAVAILABLE, with a RetryInfo, rather
// than a DEADLINE_EXCEEDED it did not cause. toStatus and the admin audit
// go by it.
func answerReason(ctx context.Context, err error) idemregv1.ErrorReason {
	r := classify(err)
	if r == reasonDeadlineExceeded && ctx.Err() == nil {
		return reasonStoreUnavailable
	}
	return r
}

// toStatus translates an error from the store into the status the client
// sees, by its reason (answerReason). It is the only place where storage
// errors meet gRPC codes. Causes of internal and unavailable errors are
// logged, never sent.
func (s *Service) toStatus(ctx context.Context, method string, k storage.Key, err error) error {
	meta := keyMeta(k)
	switch reason := answerReason(ctx, err); reason {
	case reasonQuotaExceeded:
		var exceeded *quota.Exceeded
		errors.As(err, &exceeded)
		var violations []*errdetails.QuotaFailure_Violation
		var what []string
		if exceeded.MaxConsumers > 0 {
			meta["identity"], meta["max_consumers"] = exceeded.Identity, strconv.FormatInt(exceeded.MaxConsumers, 10)
			d := fmt.Sprintf("identity %q already has %d consumers with a quota (of %s and others) followed on this replica, the most it may, so this one's usage cannot be checked; one idle for %d quota refreshes makes room",
				exceeded.Identity, exceeded.MaxConsumers, exceeded.Source, quota.IdleRefreshes)
			violations = append(violations, &errdetails.QuotaFailure_Violation{Subject: "consumer:" + exceeded.Consumer, Description: d})
			what = append(what, d)
		}
		if exceeded.MaxRecords > 0 {
			meta["max_records"], meta["records"] = strconv.FormatInt(exceeded.MaxRecords, 10), strconv.FormatInt(exceeded.Records, 10)
			d := fmt.Sprintf("at most %d live records (max_records of %s); %d known", exceeded.MaxRecords, exceeded.Source, exceeded.Records)
			violations = append(violations, &errdetails.QuotaFailure_Violation{Subject: "consumer:" + exceeded.Consumer, Description: d})
			what = append(what, d)
		}
		if exceeded.MaxBytes > 0 {
			meta["max_bytes"], meta["bytes"] = strconv.FormatInt(exceeded.MaxBytes, 10), strconv.FormatInt(exceeded.Bytes, 10)
			d := fmt.Sprintf("at most %d bytes of live records (max_bytes of %s); %d known", exceeded.MaxBytes, exceeded.Source, exceeded.Bytes)
			violations = append(violations, &errdetails.QuotaFailure_Violation{Subject: "consumer:" + exceeded.Consumer, Description: d})
			what = append(what, d)
		}
		return newStatus(reason,
			fmt.Sprintf("consumer %q is at its quota: %s; new keys are refused until its records expire, Claims of its live keys still work",
				exceeded.Consumer, strings.Join(what, "; ")), meta,
			&errdetails.QuotaFailure{Violations: violations})
	case reasonLeaseTotalExceeded:
		var total *leaseTotalExceeded
		if !errors.As(err, &total) {
			// The service gives every Extend's the bound; this one came
			// from elsewhere without it.
			return newStatus(reason, "one attempt may not hold the key any longer (max_lease_total); the lease in force is unchanged", meta)
		}
		meta["max_lease_total"] = total.max.String()
		meta["lease_not_after"] = total.notAfter.UTC().Format(time.RFC3339Nano)
		return newStatus(reason,
			fmt.Sprintf("one attempt may hold the key for at most %s (max_lease_total of %s), so no lease of this attempt may end after %s; the lease in force is unchanged",
				policy.FormatDuration(total.max), total.source, meta["lease_not_after"]), meta)
	case reasonFingerprintMismatch:
		return newStatus(reason,
			"the key is live with a different fingerprint: the same key was used with different parameters", meta)
	case reasonLeaseLost:
		return newStatus(reason,
			"the token is not the record's current token: another holder took over the key", meta)
	case reasonClaimSecretInvalid:
		return newStatus(reason, claimsecret.ErrUnknown.Error(), meta)
	case reasonAlreadyCompleted:
		return newStatus(reason, "the record is already completed", meta)
	case reasonParked:
		return newStatus(reason,
			"the record is parked: it must not be done again until an operator resolves it", meta)
	case reasonNotFound:
		return newStatus(reason, "no live record for the key (absent or expired)", meta)
	case reasonCapacityExhausted:
		resource, delay := string(storage.ResourceDisk), exhaustedRetryAfter
		var ex *storage.ExhaustedError
		if errors.As(err, &ex) {
			resource = string(ex.Resource)
			if ex.Resource == storage.ResourceConnections {
				delay = connectionsRetryAfter
			}
		}
		meta["resource"] = resource
		s.logger.WarnContext(ctx, "store capacity exhausted", "method", method, "consumer", echo(k.Consumer), "resource", resource, "error", err)
		return newStatus(reason, exhaustedMessage(resource), meta, retryInfo(delay))
	case reasonStoreUnavailable:
		if errors.Is(err, storage.ErrFailed) {
			s.logger.WarnContext(ctx, "store failed", "method", method, "consumer", echo(k.Consumer), "error", err)
			return newStatus(reason, "the store failed and the server is restarting; retry later, on another replica if there is one", meta,
				retryInfo(unavailableRetryAfter))
		}
		if errors.Is(err, context.DeadlineExceeded) {
			s.logger.WarnContext(ctx, "store did not answer before the request's deadline", "method", method, "consumer", echo(k.Consumer), "error", err)
			return newStatus(reason, "the store did not answer in time; retry later", meta,
				&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
		}
		s.logger.WarnContext(ctx, "store unavailable", "method", method, "consumer", echo(k.Consumer), "error", err)
		return newStatus(reason, "the store is unavailable; retry later", meta,
			&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
	case reasonDeadlineExceeded:
		return newStatus(reason, "the deadline ran out before the store answered", meta)
	case reasonCanceled:
		return newStatus(reason, "the request was cancelled", meta)
	case reasonOverloaded:
		var share *shareExceeded
		if errors.As(err, &share) {
			meta["identity"] = share.identity
			return newStatus(reason,
				fmt.Sprintf("identity %q already has %d store operations in flight, its share of the server's; retry later", share.identity, share.share), meta,
				&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
					Subject:     "identity:" + share.identity,
					Description: fmt.Sprintf("at most %d store operations in flight per identity", share.share),
				}}},
				retryInfo(overloadedRetryAfter))
		}
		return newStatus(reason, "the server has too many store operations in flight; retry later", meta,
			retryInfo(overloadedRetryAfter))
	default:
		s.logger.ErrorContext(ctx, "internal error", "method", method, "consumer", echo(k.Consumer), "error", err)
		return newStatus(reasonInternal, "internal error", meta)
	}
}

// exhaustedMessage is what a caller refused for a short resource is told:
// what still works, so that a holder finishes its keys rather than giving
// up.
func exhaustedMessage(resource string) string {
	switch storage.Resource(resource) {
	case storage.ResourceDisk:
		return "the store is short of disk space: Claims that would start an attempt and large results are refused until space is freed; " +
			"Completes, Releases and Extends of held keys, and reads, still work; retry later"
	case storage.ResourceConnections:
		return "the store's database refuses more connections; retry later"
	case storage.ResourceMemory:
		return "the store (or the server) is short of memory; retry later"
	case storage.ResourceFileDescriptors:
		return "the server is at its limit of open files; retry later"
	}
	return "the store is short of " + resource + "; retry later"
}
