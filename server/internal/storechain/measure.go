package storechain

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// ErrOverloaded: the store already has the most operations in flight.
var ErrOverloaded error = overloaded{}

type overloaded struct{}

func (overloaded) Error() string { return "too many store operations in flight" }

// Reason is the reason it is answered with (server/internal/reason).
func (overloaded) Reason() idemregv1.ErrorReason {
	return idemregv1.ErrorReason_ERROR_REASON_OVERLOADED
}

// ShareExceeded: the caller's identity already has its share of the
// operations in flight. It is an ErrOverloaded, answered the same way, with
// a QuotaFailure naming the identity.
type ShareExceeded struct {
	Identity string
	Share    int
}

func (e *ShareExceeded) Error() string {
	return fmt.Sprintf("identity %q has %d store operations in flight, its share", e.Identity, e.Share)
}

func (e *ShareExceeded) Unwrap() error { return ErrOverloaded }

// Reason is the reason it is answered with (server/internal/reason).
func (e *ShareExceeded) Reason() idemregv1.ErrorReason {
	return idemregv1.ErrorReason_ERROR_REASON_OVERLOADED
}

// identityShares bound the store operations in flight of each identity to
// a share of the server's, so that one tenant's flood (or its slow keys)
// leaves slots for the others instead of making their calls fail
// OVERLOADED. The counts are per identity name; names come from the config
// file, so the map stays as small as its list of identities.
type identityShares struct {
	share  int
	counts sync.Map // identity name → *atomic.Int64
}

func (s *identityShares) take(name string) bool {
	v, ok := s.counts.Load(name)
	if !ok {
		v, _ = s.counts.LoadOrStore(name, new(atomic.Int64))
	}
	n := v.(*atomic.Int64)
	if n.Add(1) > int64(s.share) {
		n.Add(-1)
		return false
	}
	return true
}

func (s *identityShares) give(name string) {
	v, _ := s.counts.Load(name)
	v.(*atomic.Int64).Add(-1)
}

// Instrument names (the server's scope), documented in docs/operations.md.
const (
	MetricClaims        = "idemreg.claims"
	MetricCompletes     = "idemreg.completes"
	MetricReleases      = "idemreg.releases"
	MetricExtends       = "idemreg.extends"
	MetricParks         = "idemreg.parks"
	MetricLeaseLost     = "idemreg.lease_lost"
	MetricStoreDuration = "idemreg.store.duration"
	MetricStoreErrors   = "idemreg.store.errors"
	MetricStoreInFlight = "idemreg.store.in_flight"
	MetricOverloaded    = "idemreg.overloaded"
	MetricBatchSize     = "idemreg.batch.size"
)

// Claim outcomes, the values of the "outcome" attribute of idemreg.claims.
const (
	ClaimAcquired   = "acquired"    // a new key, or one whose record had expired: attempt 1
	ClaimRepeat     = "repeat"      // a repeat of the Claim that holds the lease (same request_id)
	ClaimTakeover   = "takeover"    // a key released, invalidated or whose lease ran out: attempt > 1
	ClaimInProgress = "in_progress" // another holder's lease is live
	ClaimReplay     = "replay"      // completed: the stored result is replayed
	ClaimMismatch   = "mismatch"    // FINGERPRINT_MISMATCH
	ClaimParked     = "parked"      // the record is parked (or this Claim parked it at max_attempts)
)

type instruments struct {
	claims, completes, releases, extends, parks metric.Int64Counter
	leaseLost, storeErrors, overloaded          metric.Int64Counter
	storeDuration                               metric.Float64Histogram
	batchSize                                   metric.Int64Histogram
	inFlight                                    metric.Int64ObservableUpDownCounter
}

func newInstruments(m metric.Meter) (*instruments, error) {
	var (
		out  instruments
		errs []error
	)
	counter := func(dst *metric.Int64Counter, name, unit, desc string) {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		*dst = c
	}
	counter(&out.claims, MetricClaims, "{claim}", "Claims answered, by outcome: acquired, takeover, repeat, in_progress, replay, mismatch, parked.")
	counter(&out.completes, MetricCompletes, "{call}", "Successful Completes (a repeat with the same token counts again).")
	counter(&out.releases, MetricReleases, "{call}", "Successful Releases.")
	counter(&out.extends, MetricExtends, "{call}", "Successful Extends.")
	counter(&out.parks, MetricParks, "{call}", "Successful Parks (a repeat with the same token counts again).")
	counter(&out.leaseLost, MetricLeaseLost, "{call}", "Completes, Releases, Extends and Parks refused with LEASE_LOST (a stale holder's token), by method; an operator's Resolve or Invalidate that lost a race is idemreg.admin.actions{result=LEASE_LOST} instead.")
	counter(&out.storeErrors, MetricStoreErrors, "{error}", "Failed store calls, by op and error.type: unavailable, deadline, canceled, exhausted, internal.")
	counter(&out.overloaded, MetricOverloaded, "{call}", "Calls refused with OVERLOADED because the store already had the most operations in flight (bound=server) or the caller's identity had its share of them (bound=identity).")
	var err error
	out.batchSize, err = m.Int64Histogram(MetricBatchSize, metric.WithUnit("{item}"),
		metric.WithDescription("Items of BatchClaim, BatchComplete and Batch calls that reached the store, by method."),
		metric.WithExplicitBucketBoundaries(1, 2, 5, 10, 25, 50, 100, 250, 500))
	errs = append(errs, err)
	out.storeDuration, err = m.Float64Histogram(MetricStoreDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of store calls (retries included), by op and outcome: ok, or the error type."),
		metric.WithExplicitBucketBoundaries(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
	errs = append(errs, err)
	out.inFlight, err = m.Int64ObservableUpDownCounter(MetricStoreInFlight, metric.WithUnit("{call}"),
		metric.WithDescription("Store operations in flight."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("storechain: metrics: %w", err)
	}
	return &out, nil
}

// zero adds 0 to each counter's series that can be known before its first
// event (every one but those of an identity), so that they are on /metrics
// from the start: an alert on rate() sees no series for a counter that has
// not counted yet.
func (m *instruments) zero(ctx context.Context) {
	for _, c := range []metric.Int64Counter{m.completes, m.releases, m.extends, m.parks} {
		c.Add(ctx, 0)
	}
	for _, o := range claimOutcomes {
		m.claims.Add(ctx, 0, o)
	}
	for _, op := range allOps {
		if op.holder {
			m.leaseLost.Add(ctx, 0, op.method)
		}
		for _, t := range errorTypes {
			m.storeErrors.Add(ctx, 0, attrs(attribute.String("op", op.name), attribute.String("error.type", t)))
		}
	}
	m.overloaded.Add(ctx, 0, attrs(attribute.String("bound", "server")))
}

func attrs(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(kv...))
}

// opMeasures are one operation's attribute sets, built once: building a
// set per call (sorting, hashing) cost more than recording it.
type opMeasures struct {
	name   string
	ok     metric.MeasurementOption // idemreg.store.duration of a call that answered
	method metric.MeasurementOption // idemreg.lease_lost, idemreg.batch.size
	span   spanStart                // the store span's name and attributes
	// holder: the op is a lease holder's (Complete, Release, Extend,
	// Park), whose LEASE_LOST is a stale holder's and counts as
	// idemreg.lease_lost. An operator's Resolve or Invalidate that lost a
	// race with the holder is no stale holder: it is counted by
	// idemreg.admin.actions{result="LEASE_LOST"} (server/admin.go).
	holder bool
}

func newOpMeasures(op string, holder bool) *opMeasures {
	return &opMeasures{
		name:   op,
		ok:     attrs(attribute.String("op", op), attribute.String("outcome", "ok")),
		method: attrs(attribute.String("method", op)),
		span:   newSpanStart(op),
		holder: holder,
	}
}

var (
	opClaim         = newOpMeasures("claim", false)
	opComplete      = newOpMeasures("complete", true)
	opRelease       = newOpMeasures("release", true)
	opExtend        = newOpMeasures("extend", true)
	opPark          = newOpMeasures("park", true)
	opLookup        = newOpMeasures("lookup", false)
	opInspect       = newOpMeasures("inspect", false)
	opInvalidate    = newOpMeasures("invalidate", false)
	opResolve       = newOpMeasures("resolve", false)
	opList          = newOpMeasures("list", false)
	opCountParked   = newOpMeasures("count_parked", false)
	opClaimBatch    = newOpMeasures("claim_batch", false)
	opCompleteBatch = newOpMeasures("complete_batch", false) // its items' LEASE_LOST count as complete's (ops.go)
	opBatch         = newOpMeasures("batch", false)          // likewise

	allOps = []*opMeasures{opClaim, opComplete, opRelease, opExtend, opPark, opLookup, opInspect, opInvalidate,
		opResolve, opList, opCountParked, opClaimBatch, opCompleteBatch, opBatch}
)

// errorTypes are the values ErrorType returns.
var errorTypes = []string{"unavailable", "deadline", "canceled", "exhausted", "internal"}

// claimOutcomes are the attribute sets of idemreg.claims, by outcome.
var claimOutcomes = func() map[string]metric.MeasurementOption {
	m := make(map[string]metric.MeasurementOption)
	for _, o := range []string{ClaimAcquired, ClaimTakeover, ClaimRepeat, ClaimInProgress, ClaimReplay, ClaimMismatch, ClaimParked} {
		m[o] = attrs(attribute.String("outcome", o))
	}
	return m
}()

// ErrorType is the error.type of a store call that failed with reason r
// (reason.Classify): the value of idemreg.store.errors' error.type and of
// idemreg.store.duration's outcome. Only failures have one: the registry's
// answers (reason.IsAnswer) are not failures of the store.
func ErrorType(r idemregv1.ErrorReason) string {
	switch r {
	case idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED:
		return "deadline"
	case idemregv1.ErrorReason_ERROR_REASON_CANCELED:
		return "canceled"
	case idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE:
		return "unavailable"
	case idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED:
		return "exhausted"
	default:
		return "internal"
	}
}

// do runs one record operation under the store's deadline and the
// in-flight bounds, and records it.
func (c *Chain) do(ctx context.Context, op *opMeasures, call func(ctx context.Context) error) error {
	id := ""
	if c.shares != nil {
		id = c.identity(ctx)
	}
	if id != "" && !c.shares.take(id) {
		c.m.overloaded.Add(ctx, 1, attrs(attribute.String("identity", id), attribute.String("bound", "identity")))
		return &ShareExceeded{Identity: id, Share: c.shares.share}
	}
	select {
	case c.sem <- struct{}{}:
	default:
		if id != "" {
			c.shares.give(id)
		}
		c.m.overloaded.Add(ctx, 1, attrs(attribute.String("bound", "server")))
		return ErrOverloaded
	}
	sctx, cancel := storeContext(ctx)
	sctx, span := c.startSpan(sctx, op)
	start := time.Now()
	err := call(sctx)
	elapsed := time.Since(start).Seconds()
	if span != nil {
		endSpan(span, err)
	}
	cancel()
	<-c.sem
	if id != "" {
		c.shares.give(id)
	}
	c.outcome(err)
	r := reason.Classify(err)
	if err != nil && !reason.IsAnswer(r) {
		outcome := ErrorType(r)
		opAttr := attribute.String("op", op.name)
		c.m.storeErrors.Add(ctx, 1, attrs(opAttr, attribute.String("error.type", outcome)))
		c.m.storeDuration.Record(ctx, elapsed, attrs(opAttr, attribute.String("outcome", outcome)))
	} else {
		c.m.storeDuration.Record(ctx, elapsed, op.ok)
	}
	if op.holder && r == idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST {
		c.m.leaseLost.Add(ctx, 1, op.method)
	}
	return err
}
