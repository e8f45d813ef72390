package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/internal/storechain"
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

// exhaustLogEvery spaces the log lines of CAPACITY_EXHAUSTED refusals;
// exhaustedLogged is when the last was written (Unix ns), for the
// process, whose store they share.
const exhaustLogEvery = 10 * time.Second

var exhaustedLogged atomic.Int64

// overloadedRetryAfter is the RetryInfo delay suggested when the store has
// the most operations in flight: short, since the slots free up quickly.
const overloadedRetryAfter = 100 * time.Millisecond

func invalidArgument(v violations) error {
	return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INVALID_ARGUMENT, "invalid request: "+v[0].Field+": "+v[0].Description,
		nil, &errdetails.BadRequest{FieldViolations: v})
}

func keyMeta(k storage.Key) map[string]string {
	return map[string]string{"consumer": k.Consumer, "kind": kindName(k.Kind), "key": k.Key}
}

// statuses translate errors into statuses; both services have them, with
// the logger the causes of failures go to.
type statuses struct{ logger *slog.Logger }

// toStatus translates an error from the store into the status the client
// sees, by its reason (reason.Answer). It is the only place where storage
// errors meet gRPC codes. Causes of internal and unavailable errors are
// logged, never sent.
func (s statuses) toStatus(ctx context.Context, method string, k storage.Key, err error) error {
	meta := keyMeta(k)
	switch r := reason.Answer(ctx, err); r {
	case idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED:
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
		if exceeded.Replicas > 1 {
			// The share of what was left at the last count: another
			// replica may still admit, and the next count may too.
			meta["replicas"] = strconv.FormatInt(exceeded.Replicas, 10)
			what = append(what, fmt.Sprintf("this replica has admitted its share (1/%d of what was left at the last count) of the %d live replicas'", exceeded.Replicas, exceeded.Replicas))
		}
		return reason.Status(r,
			fmt.Sprintf("consumer %q is at its quota: %s; new keys are refused until its records expire, Claims of its live keys still work",
				exceeded.Consumer, strings.Join(what, "; ")), meta,
			&errdetails.QuotaFailure{Violations: violations})
	case idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED:
		var total *leaseTotalExceeded
		if !errors.As(err, &total) {
			// The service gives every Extend's the bound; this one came
			// from elsewhere without it.
			return reason.Status(r, "one attempt may not hold the key any longer (max_lease_total); the lease in force is unchanged", meta)
		}
		meta["max_lease_total"] = total.max.String()
		meta["lease_not_after"] = total.notAfter.UTC().Format(time.RFC3339Nano)
		return reason.Status(r,
			fmt.Sprintf("one attempt may hold the key for at most %s (max_lease_total of %s), so no lease of this attempt may end after %s; the lease in force is unchanged",
				policy.FormatDuration(total.max), total.source, meta["lease_not_after"]), meta)
	case idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH:
		return reason.Status(r,
			"the key is live with a different fingerprint: the same key was used with different parameters", meta)
	case idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST:
		return reason.Status(r,
			"the token is not the record's current token: another holder took over the key", meta)
	case idemregv1.ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID:
		return reason.Status(r, claimsecret.ErrUnknown.Error(), meta)
	case idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED:
		return reason.Status(r, "the record is already completed", meta)
	case idemregv1.ErrorReason_ERROR_REASON_PARKED:
		return reason.Status(r,
			"the record is parked: it must not be done again until an operator resolves it", meta)
	case idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND:
		return reason.Status(r, "no live record for the key (absent or expired)", meta)
	case idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED:
		resource, delay := string(storage.ResourceDisk), exhaustedRetryAfter
		var ex *storage.ExhaustedError
		if errors.As(err, &ex) {
			resource = string(ex.Resource)
			if ex.Resource == storage.ResourceConnections {
				delay = connectionsRetryAfter
			}
		}
		meta["resource"] = resource
		// One line per exhaustLogEvery, not one per refusal: the refusals
		// of a full disk come as fast as callers call, and the embedded
		// store logs its changes of level itself. The cause (a SQLSTATE)
		// is in the line; the access log has every call.
		if now, last := time.Now().UnixNano(), exhaustedLogged.Load(); now-last >= int64(exhaustLogEvery) && exhaustedLogged.CompareAndSwap(last, now) {
			s.logger.WarnContext(ctx, "store capacity exhausted", "method", method, "consumer", reason.Echo(k.Consumer), "resource", resource, "error", err,
				"next_line_after", exhaustLogEvery)
		}
		return reason.Status(r, exhaustedMessage(resource), meta, reason.RetryInfo(delay))
	case idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE:
		if errors.Is(err, storage.ErrFailed) {
			s.logger.WarnContext(ctx, "store failed", "method", method, "consumer", reason.Echo(k.Consumer), "error", err)
			return reason.Status(r, "the store failed and the server is restarting; retry later, on another replica if there is one", meta,
				reason.RetryInfo(unavailableRetryAfter))
		}
		if errors.Is(err, context.DeadlineExceeded) {
			s.logger.WarnContext(ctx, "store did not answer before the request's deadline", "method", method, "consumer", reason.Echo(k.Consumer), "error", err)
			return reason.Status(r, "the store did not answer in time; retry later", meta,
				&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
		}
		s.logger.WarnContext(ctx, "store unavailable", "method", method, "consumer", reason.Echo(k.Consumer), "error", err)
		return reason.Status(r, "the store is unavailable; retry later", meta,
			&errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryAfter)})
	case idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED:
		return reason.Status(r, "the deadline ran out before the store answered", meta)
	case idemregv1.ErrorReason_ERROR_REASON_CANCELED:
		return reason.Status(r, "the request was cancelled", meta)
	case idemregv1.ErrorReason_ERROR_REASON_OVERLOADED:
		var share *storechain.ShareExceeded
		if errors.As(err, &share) {
			meta["identity"] = share.Identity
			return reason.Status(r,
				fmt.Sprintf("identity %q already has %d store operations in flight, its share of the server's; retry later", share.Identity, share.Share), meta,
				&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
					Subject:     "identity:" + share.Identity,
					Description: fmt.Sprintf("at most %d store operations in flight per identity", share.Share),
				}}},
				reason.RetryInfo(overloadedRetryAfter))
		}
		return reason.Status(r, "the server has too many store operations in flight; retry later", meta,
			reason.RetryInfo(overloadedRetryAfter))
	default:
		s.logger.ErrorContext(ctx, "internal error", "method", method, "consumer", reason.Echo(k.Consumer), "error", err)
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", meta)
	}
}

// exhaustedMessage is what a caller refused for a short resource is told:
// what still works, so that a holder finishes its keys rather than giving
// up.
func exhaustedMessage(resource string) string {
	switch storage.Resource(resource) {
	case storage.ResourceDisk:
		return "the store is short of disk space: new work is refused until space is freed; reads still work, and so do Completes, " +
			"Releases and Extends of held keys where the store keeps room for them (the embedded store keeps a reserve); retry later"
	case storage.ResourceConnections:
		return "the store's database refuses more connections; retry later"
	case storage.ResourceMemory:
		return "the store (or the server) is short of memory; retry later"
	case storage.ResourceFileDescriptors:
		return "the server is at its limit of open files; retry later"
	}
	return "the store is short of " + resource + "; retry later"
}
