package server

import (
	"context"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Bounds of the part of a request's remaining time kept back from the
// store: a tenth of it, between these.
const (
	minDeadlineMargin = 20 * time.Millisecond
	maxDeadlineMargin = time.Second
)

// storeContext gives a store call a deadline a little before the request's
// own. A store that does not answer (a statement stuck on a connection that
// went silent, a pool waiting for a connection that never comes) then
// leaves the service the time to answer UNAVAILABLE with a RetryInfo while
// the client still waits, rather than the client's deadline turning the
// call into a bare DEADLINE_EXCEEDED; toStatus tells the two apart by
// whether the request's own context has ended.
func storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := storeDeadline(ctx)
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithDeadline(ctx, d)
}

// storeDeadline is the request's deadline less the margin kept back from
// the store (a tenth of the time left, between the bounds above); false
// when the request has none.
func storeDeadline(ctx context.Context) (time.Time, bool) {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Time{}, false
	}
	return d.Add(-min(max(time.Until(d)/10, minDeadlineMargin), maxDeadlineMargin)), true
}

// marginStore is the chain's outermost decorator (storechain.go): it runs
// every record operation under storeContext, the admin operations as
// those of the registry. The rest passes through.
type marginStore struct{ next proxyStore }

var _ proxyStore = marginStore{}

func (s marginStore) Unwrap() storage.Store { return s.next }

func (s marginStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Claim(ctx, p)
}

func (s marginStore) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Complete(ctx, p)
}

func (s marginStore) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.ClaimBatch(ctx, ps)
}

func (s marginStore) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.CompleteBatch(ctx, ps)
}

func (s marginStore) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Release(ctx, p)
}

func (s marginStore) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Extend(ctx, p)
}

func (s marginStore) Lookup(ctx context.Context, k storage.Key) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Lookup(ctx, k)
}

func (s marginStore) Park(ctx context.Context, p storage.ParkParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Park(ctx, p)
}

func (s marginStore) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Inspect(ctx, k)
}

func (s marginStore) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Invalidate(ctx, p)
}

func (s marginStore) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.Resolve(ctx, p)
}

func (s marginStore) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.List(ctx, p)
}

func (s marginStore) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.next.CountParked(ctx, prefix)
}

// Passed through.

func (s marginStore) Ping(ctx context.Context) error { return s.next.Ping(ctx) }
func (s marginStore) Close() error                   { return s.next.Close() }
func (s marginStore) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	return s.next.ClaimKeyRing(ctx)
}

func (s marginStore) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	return s.next.RotateClaimKey(ctx, p)
}

func (s marginStore) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	return s.next.ConsumerUsage(ctx, consumers)
}

func (s marginStore) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	return s.next.SweepExpired(ctx, limit)
}

func (s marginStore) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	return s.next.OldestExpiry(ctx)
}
