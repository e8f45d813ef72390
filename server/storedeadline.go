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
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	margin := min(max(time.Until(d)/10, minDeadlineMargin), maxDeadlineMargin)
	return context.WithDeadline(ctx, d.Add(-margin))
}

// marginStore runs every store call of the service under storeContext.
type marginStore struct{ storage.Store }

func (s marginStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Claim(ctx, p)
}

func (s marginStore) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Complete(ctx, p)
}

func (s marginStore) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return storage.ClaimBatch(ctx, s.Store, ps)
}

func (s marginStore) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return storage.CompleteBatch(ctx, s.Store, ps)
}

func (s marginStore) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Release(ctx, p)
}

func (s marginStore) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Extend(ctx, p)
}

func (s marginStore) Lookup(ctx context.Context, k storage.Key) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Lookup(ctx, k)
}

func (s marginStore) Park(ctx context.Context, p storage.ParkParams) (storage.Record, error) {
	ctx, cancel := storeContext(ctx)
	defer cancel()
	return s.Store.Park(ctx, p)
}
