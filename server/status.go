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
	ReasonAlreadyCompleted    = idemregv1.ReasonAlreadyCompleted
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
)

// unavailableRetryAfter is the RetryInfo delay suggested when the store is
// unavailable.
const unavailableRetryAfter = time.Second

// overloadedRetryAfter is the RetryInfo delay suggested when the store has
// the most operations in flight: short, since the slots free up quickly.
const overloadedRetryAfter = 100 * time.Millisecond

// newStatus builds the status of a refusal: the code is the reason's
// (ErrorReason.Code), so that a reason never comes with another. Its message
// and metadata values are cut to the bounds of bounds.go here, once, so that
// no caller can make a status larger than they are whatever it quotes.
func newStatus(reason idemregv1.ErrorReason, msg string, meta map[string]string, extra ...protoadapt.MessageV1) error {
	for k, v := range meta {
		meta[k] = echo(v)
	}
	st := status.New(reason.Code(), truncate(msg, MaxStatusMessageBytes))
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason.Reason(), Domain: ErrorDomain, Metadata: meta}}, extra...)
	if withDetails, err := st.WithDetails(details...); err == nil {
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

// toStatus translates an error from the store into the status the client
// sees. It is the only place where storage errors meet gRPC codes. Causes of
// internal and unavailable errors are logged, never sent.
func (s *Service) toStatus(ctx context.Context, method string, k storage.Key, err error) error {
	meta := keyMeta(k)
	var share *shareExceeded
	var total *leaseTotalExceeded
	var quota *quotaExceeded
	switch {
	case errors.As(err, &quota):
		var violations []*errdetails.QuotaFailure_Violation
		var what []string
		if quota.maxRecords > 0 {
			meta["max_records"], meta["records"] = strconv.FormatInt(quota.maxRecords, 10), strconv.FormatInt(quota.records, 10)
			d := fmt.Sprintf("at most %d live records (max_records of %s); %d known", quota.maxRecords, quota.source, quota.records)
			violations = append(violations, &errdetails.QuotaFailure_Violation{Subject: "consumer:" + quota.consumer, Description: d})
			what = append(what, d)
		}
		if quota.maxBytes > 0 {
			meta["max_bytes"], meta["bytes"] = strconv.FormatInt(quota.maxBytes, 10), strconv.FormatInt(quota.bytes, 10)
			d := fmt.Sprintf("at most %d bytes of live records (max_bytes of %s); %d known", quota.maxBytes, quota.source, quota.bytes)
			violations = append(violations, &errdetails.QuotaFailure_Violation{Subject: "consumer:" + quota.consumer, Description: d})
			what = append(what, d)
		}
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED,
			fmt.Sprintf("consumer %q is at its quota: %s; new keys are refused until its records expire, Claims of its live keys still work",
				quota.consumer, strings.Join(what, "; ")), meta,
			&errdetails.QuotaFailure{Violations: violations})
	case errors.As(err, &total):
		meta["max_lease_total"] = total.max.String()
		meta["lease_not_after"] = total.notAfter.UTC().Format(time.RFC3339Nano)
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED,
			fmt.Sprintf("one attempt may hold the key for at most %s (max_lease_total of %s), so no lease of this attempt may end after %s; the lease in force is unchanged",
				policy.FormatDuration(total.max), total.source, meta["lease_not_after"]), meta)
	case errors.Is(err, storage.ErrFingerprintMismatch):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH,
			"the key is live with a different fingerprint: the same key was used with different parameters", meta)
	case errors.Is(err, storage.ErrLeaseLost):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST,
			"the token is not the record's current token: another holder took over the key", meta)
	case errors.Is(err, storage.ErrAlreadyCompleted):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED, "the record is already completed", meta)
	case errors.Is(err, storage.ErrParked):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_PARKED,
			"the record is parked: it must not be done again until an operator resolves it", meta)
	case errors.Is(err, storage.ErrNotFound):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND, "no live record for the key (absent or expired)", meta)
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		// The store's share of the request's time ran out (storeContext)
		// and the client still waits: the store did not answer in time.
		s.logger.WarnContext(ctx, "store did not answer before the request's deadline", "method", method, "consumer", echo(k.Consumer), "error", err)
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "the store did not answer in time; retry later", meta,
			&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
	case errors.Is(err, context.DeadlineExceeded):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED, "the deadline ran out before the store answered", meta)
	case errors.Is(err, context.Canceled):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_CANCELED, "the request was cancelled", meta)
	case errors.As(err, &share):
		meta["identity"] = share.identity
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_OVERLOADED,
			fmt.Sprintf("identity %q already has %d store operations in flight, its share of the server's; retry later", share.identity, share.share), meta,
			&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
				Subject:     "identity:" + share.identity,
				Description: fmt.Sprintf("at most %d store operations in flight per identity", share.share),
			}}},
			retryInfo(overloadedRetryAfter))
	case errors.Is(err, errOverloaded):
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_OVERLOADED, "the server has too many store operations in flight; retry later", meta,
			retryInfo(overloadedRetryAfter))
	case errors.Is(err, storage.ErrUnavailable):
		s.logger.WarnContext(ctx, "store unavailable", "method", method, "consumer", echo(k.Consumer), "error", err)
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "the store is unavailable; retry later", meta,
			&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
	default:
		s.logger.ErrorContext(ctx, "internal error", "method", method, "consumer", echo(k.Consumer), "error", err)
		return newStatus(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", meta)
	}
}
