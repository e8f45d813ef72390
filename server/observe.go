package server

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/storage"
)

// errOverloaded: the store already has the most operations in flight that
// the server allows. toStatus answers it with UNAVAILABLE, reason OVERLOADED.
var errOverloaded error = overloaded{}

type overloaded struct{}

func (overloaded) Error() string { return "too many store operations in flight" }

func (overloaded) Reason() idemregv1.ErrorReason {
	return idemregv1.ErrorReason_ERROR_REASON_OVERLOADED
}

// shareExceeded: the caller's identity already has its share of the
// operations in flight. It is an errOverloaded, answered the same way, with
// a QuotaFailure naming the identity.
type shareExceeded struct {
	identity string
	share    int
}

func (e *shareExceeded) Error() string {
	return fmt.Sprintf("identity %q has %d store operations in flight, its share", e.identity, e.share)
}

func (e *shareExceeded) Unwrap() error { return errOverloaded }

func (e *shareExceeded) Reason() idemregv1.ErrorReason {
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

// observedStore is the chain's decorator (storechain.go) that bounds the
// operations in flight, so that overload is answered at once instead of
// queueing behind the store's connection pool until deadlines run out, and
// measures every record operation and counts its outcome for readiness.
// What is no record operation (Ping, the claim key, usage counts, the
// sweeper) passes through: health must see the store as it is, not as the
// queue is.
type observedStore struct {
	next proxyStore
	sem  chan struct{}
	// shares is nil when an identity may take every slot.
	shares *identityShares
	m      *metrics
	// outcomes counts the calls that reached the store, for readiness.
	outcomes *callOutcomes
}

var _ proxyStore = (*observedStore)(nil)

// newObservedStore bounds the operations in flight to maxInFlight, and
// those of each authenticated identity to perIdentity when it is less.
func newObservedStore(next proxyStore, maxInFlight, perIdentity int, m *metrics, outcomes *callOutcomes) (*observedStore, error) {
	o := &observedStore{next: next, sem: make(chan struct{}, maxInFlight), m: m, outcomes: outcomes}
	if perIdentity < maxInFlight {
		o.shares = &identityShares{share: perIdentity}
	}
	// The in-flight gauge is read off the bound when metrics are
	// collected, which costs the calls nothing.
	_, err := m.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		obs.ObserveInt64(m.inFlight, int64(len(o.sem)))
		return nil
	}, m.inFlight)
	if err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	return o, nil
}

func (o *observedStore) Unwrap() storage.Store { return o.next }

// opMeasures are one operation's attribute sets, built once: building a
// set per call (sorting, hashing) cost more than recording it.
type opMeasures struct {
	name   string
	ok     metric.MeasurementOption // idemreg.store.duration of a call that answered
	method metric.MeasurementOption // idemreg.lease_lost
}

func newOpMeasures(op string) *opMeasures {
	return &opMeasures{
		name:   op,
		ok:     attrs(attribute.String("op", op), attribute.String("outcome", "ok")),
		method: attrs(attribute.String("method", op)),
	}
}

var (
	opClaim         = newOpMeasures("claim")
	opComplete      = newOpMeasures("complete")
	opRelease       = newOpMeasures("release")
	opExtend        = newOpMeasures("extend")
	opPark          = newOpMeasures("park")
	opLookup        = newOpMeasures("lookup")
	opInspect       = newOpMeasures("inspect")
	opInvalidate    = newOpMeasures("invalidate")
	opResolve       = newOpMeasures("resolve")
	opList          = newOpMeasures("list")
	opCountParked   = newOpMeasures("count_parked")
	opClaimBatch    = newOpMeasures("claim_batch")
	opCompleteBatch = newOpMeasures("complete_batch")
)

// claimOutcomes are the attribute sets of idemreg.claims, by outcome.
var claimOutcomes = func() map[string]metric.MeasurementOption {
	m := make(map[string]metric.MeasurementOption)
	for _, o := range []string{ClaimAcquired, ClaimTakeover, ClaimRepeat, ClaimInProgress, ClaimReplay, ClaimMismatch, ClaimParked} {
		m[o] = attrs(attribute.String("outcome", o))
	}
	return m
}()

// do runs one store call under the in-flight bounds and records it. The
// anonymous identity of an open server is every caller, not a tenant, so
// it has no share of its own.
func (o *observedStore) do(ctx context.Context, op *opMeasures, call func() error) error {
	id, _ := IdentityFrom(ctx)
	shared := o.shares != nil && id != nil && id != access.Anonymous
	if shared && !o.shares.take(id.Name) {
		o.m.overloaded.Add(ctx, 1, attrs(attribute.String("identity", id.Name), attribute.String("bound", "identity")))
		return &shareExceeded{identity: id.Name, share: o.shares.share}
	}
	select {
	case o.sem <- struct{}{}:
	default:
		if shared {
			o.shares.give(id.Name)
		}
		o.m.overloaded.Add(ctx, 1, attrs(attribute.String("bound", "server")))
		return errOverloaded
	}
	start := time.Now()
	err := call()
	elapsed := time.Since(start).Seconds()
	<-o.sem
	if shared {
		o.shares.give(id.Name)
	}
	o.outcomes.record(err)
	r := reason.Classify(err)
	if err != nil && !reason.IsAnswer(r) {
		outcome := storeErrorType(r)
		opAttr := attribute.String("op", op.name)
		o.m.storeErrors.Add(ctx, 1, attrs(opAttr, attribute.String("error.type", outcome)))
		o.m.storeDuration.Record(ctx, elapsed, attrs(opAttr, attribute.String("outcome", outcome)))
	} else {
		o.m.storeDuration.Record(ctx, elapsed, op.ok)
	}
	if r == idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST {
		o.m.leaseLost.Add(ctx, 1, op.method)
	}
	return err
}

func (o *observedStore) Claim(ctx context.Context, p storage.ClaimParams) (res storage.ClaimResult, err error) {
	err = o.do(ctx, opClaim, func() error {
		res, err = o.next.Claim(ctx, p)
		return err
	})
	o.countClaim(ctx, res, err)
	return res, err
}

func (o *observedStore) countClaim(ctx context.Context, res storage.ClaimResult, err error) {
	var outcome string
	switch {
	case reason.Classify(err) == idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH:
		outcome = ClaimMismatch
	case err != nil:
		return
	case res.Repeated:
		outcome = ClaimRepeat
	case res.Outcome == storage.OutcomeAcquired && res.Record.Attempt > 1:
		outcome = ClaimTakeover
	case res.Outcome == storage.OutcomeAcquired:
		outcome = ClaimAcquired
	case res.Outcome == storage.OutcomeInProgress:
		outcome = ClaimInProgress
	case res.Outcome == storage.OutcomeCompleted:
		outcome = ClaimReplay
	case res.Outcome == storage.OutcomeParked:
		outcome = ClaimParked
	}
	o.m.claims.Add(ctx, 1, claimOutcomes[outcome])
}

// ClaimBatch implements storage.Batcher: a batch is one operation in
// flight, and each item counts as a Claim.
func (o *observedStore) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) (out []storage.ClaimAnswer) {
	ran := false
	err := o.do(ctx, opClaimBatch, func() error {
		ran = true
		out = o.next.ClaimBatch(ctx, ps)
		for _, a := range out {
			if a.Err != nil && !reason.IsAnswer(reason.Classify(a.Err)) {
				return a.Err // the store failed: measured, and counted for readiness
			}
		}
		return nil
	})
	if !ran { // refused before the store: every item's answer
		out = make([]storage.ClaimAnswer, len(ps))
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	o.m.batchSize.Record(ctx, int64(len(ps)), opClaimBatch.method)
	for _, a := range out {
		o.countClaim(ctx, a.Result, a.Err)
	}
	return out
}

// CompleteBatch implements storage.Batcher like ClaimBatch.
func (o *observedStore) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) (out []storage.CompleteAnswer) {
	ran := false
	err := o.do(ctx, opCompleteBatch, func() error {
		ran = true
		out = o.next.CompleteBatch(ctx, ps)
		for _, a := range out {
			if a.Err != nil && !reason.IsAnswer(reason.Classify(a.Err)) {
				return a.Err // the store failed: measured, and counted for readiness
			}
		}
		return nil
	})
	if !ran { // refused before the store: every item's answer
		out = make([]storage.CompleteAnswer, len(ps))
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	o.m.batchSize.Record(ctx, int64(len(ps)), opCompleteBatch.method)
	for _, a := range out {
		switch {
		case a.Err == nil:
			o.m.completes.Add(ctx, 1)
		case reason.Classify(a.Err) == idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST:
			o.m.leaseLost.Add(ctx, 1, opComplete.method)
		}
	}
	return out
}

func (o *observedStore) Complete(ctx context.Context, p storage.CompleteParams) (rec storage.Record, err error) {
	err = o.do(ctx, opComplete, func() error {
		rec, err = o.next.Complete(ctx, p)
		return err
	})
	if err == nil {
		o.m.completes.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Release(ctx context.Context, p storage.ReleaseParams) (rec storage.Record, err error) {
	err = o.do(ctx, opRelease, func() error {
		rec, err = o.next.Release(ctx, p)
		return err
	})
	if err == nil {
		o.m.releases.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Extend(ctx context.Context, p storage.ExtendParams) (rec storage.Record, err error) {
	err = o.do(ctx, opExtend, func() error {
		rec, err = o.next.Extend(ctx, p)
		return err
	})
	if err == nil {
		o.m.extends.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Park(ctx context.Context, p storage.ParkParams) (rec storage.Record, err error) {
	err = o.do(ctx, opPark, func() error {
		rec, err = o.next.Park(ctx, p)
		return err
	})
	if err == nil {
		o.m.parks.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Lookup(ctx context.Context, k storage.Key) (rec storage.Record, err error) {
	err = o.do(ctx, opLookup, func() error {
		rec, err = o.next.Lookup(ctx, k)
		return err
	})
	return rec, err
}

func (o *observedStore) Inspect(ctx context.Context, k storage.Key) (res storage.InspectResult, err error) {
	err = o.do(ctx, opInspect, func() error {
		res, err = o.next.Inspect(ctx, k)
		return err
	})
	return res, err
}

func (o *observedStore) Invalidate(ctx context.Context, p storage.InvalidateParams) (rec storage.Record, err error) {
	err = o.do(ctx, opInvalidate, func() error {
		rec, err = o.next.Invalidate(ctx, p)
		return err
	})
	return rec, err
}

func (o *observedStore) Resolve(ctx context.Context, p storage.ResolveParams) (rec storage.Record, err error) {
	err = o.do(ctx, opResolve, func() error {
		rec, err = o.next.Resolve(ctx, p)
		return err
	})
	return rec, err
}

func (o *observedStore) List(ctx context.Context, p storage.ListParams) (res storage.ListResult, err error) {
	err = o.do(ctx, opList, func() error {
		res, err = o.next.List(ctx, p)
		return err
	})
	return res, err
}

func (o *observedStore) CountParked(ctx context.Context, prefix string) (counts map[string]int64, err error) {
	err = o.do(ctx, opCountParked, func() error {
		counts, err = o.next.CountParked(ctx, prefix)
		return err
	})
	return counts, err
}

// Passed through.

func (o *observedStore) Ping(ctx context.Context) error { return o.next.Ping(ctx) }
func (o *observedStore) Close() error                   { return o.next.Close() }
func (o *observedStore) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	return o.next.ClaimKeyRing(ctx)
}

func (o *observedStore) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	return o.next.RotateClaimKey(ctx, p)
}

func (o *observedStore) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	return o.next.ConsumerUsage(ctx, consumers)
}

func (o *observedStore) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	return o.next.SweepExpired(ctx, limit)
}

func (o *observedStore) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	return o.next.OldestExpiry(ctx)
}
