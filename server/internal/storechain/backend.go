package storechain

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// errNoCapability answers a call of a capability the backend lacks; the
// chain says it is absent, so only a bug makes one (INTERNAL).
var errNoCapability = fmt.Errorf("storechain: the store lacks the capability: %w", errors.ErrUnsupported)

// backend is the bottom of the chain: the backend, its optional
// capabilities found once. Batches fall back to one call after the other
// (storage.ClaimBatch) on a backend that is no Batcher, and mixed batches
// to rounds of those (storage.Batch) on one that is no MixedBatcher.
type backend struct {
	storage.Store
	admin   storage.Admin
	sweeper storage.Sweeper
	keys    storage.ClaimKeys
	usage   storage.UsageCounter
}

func newBackend(s storage.Store) backend {
	b := backend{Store: s}
	b.admin, _ = s.(storage.Admin)
	b.sweeper, _ = s.(storage.Sweeper)
	b.keys, _ = s.(storage.ClaimKeys)
	b.usage, _ = s.(storage.UsageCounter)
	return b
}

func (b backend) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	return storage.ClaimBatch(ctx, b.Store, ps)
}

func (b backend) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	return storage.CompleteBatch(ctx, b.Store, ps)
}

// Batch is one batch on a storage.MixedBatcher, else storage.Batch's
// rounds of ClaimBatch and CompleteBatch.
func (b backend) Batch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	return storage.Batch(ctx, b.Store, ops)
}

func (b backend) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	if b.admin == nil {
		return storage.InspectResult{}, errNoCapability
	}
	return b.admin.Inspect(ctx, k)
}

func (b backend) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	if b.admin == nil {
		return storage.Record{}, errNoCapability
	}
	return b.admin.Invalidate(ctx, p)
}

func (b backend) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	if b.admin == nil {
		return storage.Record{}, errNoCapability
	}
	return b.admin.Resolve(ctx, p)
}

func (b backend) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	if b.admin == nil {
		return storage.ListResult{}, errNoCapability
	}
	return b.admin.List(ctx, p)
}

func (b backend) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	if b.admin == nil {
		return nil, errNoCapability
	}
	return b.admin.CountParked(ctx, prefix)
}

func (b backend) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	if b.sweeper == nil {
		return storage.SweepResult{}, errNoCapability
	}
	return b.sweeper.SweepExpired(ctx, limit)
}

func (b backend) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	if b.sweeper == nil {
		return time.Time{}, time.Time{}, false, errNoCapability
	}
	return b.sweeper.OldestExpiry(ctx)
}

func (b backend) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	if b.keys == nil {
		return storage.ClaimKeyRing{}, errNoCapability
	}
	return b.keys.ClaimKeyRing(ctx)
}

func (b backend) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	if b.keys == nil {
		return storage.ClaimKeyRing{}, errNoCapability
	}
	return b.keys.RotateClaimKey(ctx, p)
}

func (b backend) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	if b.usage == nil {
		return nil, errNoCapability
	}
	return b.usage.ConsumerUsage(ctx, consumers)
}
