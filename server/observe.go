package server

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemreg/idemreg/storage"
)

// errOverloaded: the store already has the most operations in flight that
// the server allows. toStatus answers it with UNAVAILABLE, reason OVERLOADED.
var errOverloaded = errors.New("too many store operations in flight")

// observedStore wraps the store the service calls: it bounds the
// operations in flight, so that overload is answered at once instead of
// queueing behind the store's connection pool until deadlines run out, and
// it measures every call. Ping bypasses both: health must see the store as
// it is, not as the queue is.
type observedStore struct {
	storage.Store
	admin storage.Admin // nil when the store has no admin capability
	sem   chan struct{}
	m     *metrics
}

func newObservedStore(s storage.Store, maxInFlight int, m *metrics) *observedStore {
	o := &observedStore{Store: s, sem: make(chan struct{}, maxInFlight), m: m}
	o.admin, _ = s.(storage.Admin)
	return o
}

// do runs one store call under the in-flight bound and records it.
func (o *observedStore) do(ctx context.Context, op string, call func() error) error {
	select {
	case o.sem <- struct{}{}:
	default:
		o.m.overloaded.Add(ctx, 1)
		return errOverloaded
	}
	opAttr := attribute.String("op", op)
	o.m.inFlight.Add(ctx, 1, attrs(opAttr))
	start := time.Now()
	err := call()
	elapsed := time.Since(start).Seconds()
	o.m.inFlight.Add(ctx, -1, attrs(opAttr))
	<-o.sem
	outcome := "ok"
	if err != nil && !isAnswer(err) {
		outcome = errorType(err)
		o.m.storeErrors.Add(ctx, 1, attrs(opAttr, attribute.String("error.type", outcome)))
	}
	o.m.storeDuration.Record(ctx, elapsed, attrs(opAttr, attribute.String("outcome", outcome)))
	if errors.Is(err, storage.ErrLeaseLost) {
		o.m.leaseLost.Add(ctx, 1, attrs(attribute.String("method", op)))
	}
	return err
}

func (o *observedStore) Claim(ctx context.Context, p storage.ClaimParams) (res storage.ClaimResult, err error) {
	err = o.do(ctx, "claim", func() error {
		res, err = o.Store.Claim(ctx, p)
		return err
	})
	var outcome string
	switch {
	case errors.Is(err, storage.ErrFingerprintMismatch):
		outcome = ClaimMismatch
	case err != nil:
		return res, err
	case res.Outcome == storage.OutcomeAcquired && res.Record.Attempt > 1:
		outcome = ClaimTakeover
	case res.Outcome == storage.OutcomeAcquired:
		outcome = ClaimAcquired
	case res.Outcome == storage.OutcomeInProgress:
		outcome = ClaimInProgress
	case res.Outcome == storage.OutcomeCompleted:
		outcome = ClaimReplay
	}
	o.m.claims.Add(ctx, 1, attrs(attribute.String("outcome", outcome)))
	return res, err
}

func (o *observedStore) Complete(ctx context.Context, p storage.CompleteParams) (rec storage.Record, err error) {
	err = o.do(ctx, "complete", func() error {
		rec, err = o.Store.Complete(ctx, p)
		return err
	})
	if err == nil {
		o.m.completes.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Release(ctx context.Context, p storage.ReleaseParams) (rec storage.Record, err error) {
	err = o.do(ctx, "release", func() error {
		rec, err = o.Store.Release(ctx, p)
		return err
	})
	if err == nil {
		o.m.releases.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Extend(ctx context.Context, p storage.ExtendParams) (rec storage.Record, err error) {
	err = o.do(ctx, "extend", func() error {
		rec, err = o.Store.Extend(ctx, p)
		return err
	})
	if err == nil {
		o.m.extends.Add(ctx, 1)
	}
	return rec, err
}

func (o *observedStore) Lookup(ctx context.Context, k storage.Key) (rec storage.Record, err error) {
	err = o.do(ctx, "lookup", func() error {
		rec, err = o.Store.Lookup(ctx, k)
		return err
	})
	return rec, err
}

func (o *observedStore) Inspect(ctx context.Context, k storage.Key) (res storage.InspectResult, err error) {
	err = o.do(ctx, "inspect", func() error {
		res, err = o.admin.Inspect(ctx, k)
		return err
	})
	return res, err
}

func (o *observedStore) Invalidate(ctx context.Context, p storage.InvalidateParams) (rec storage.Record, err error) {
	err = o.do(ctx, "invalidate", func() error {
		rec, err = o.admin.Invalidate(ctx, p)
		return err
	})
	return rec, err
}
