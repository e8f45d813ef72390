package server

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// The store chain: the decorators every store call of a request goes
// through, built once by newStoreChain and used by the RegistryService and
// the AdminService alike (SpiceDB's internal/datastore/proxy is the model).
// Outermost first:
//
//  1. marginStore (storedeadline.go): a record operation gets the request's
//     deadline less a margin, so that a silent store is answered
//     STORE_UNAVAILABLE while the client still waits;
//  2. observedStore (observe.go): the bounds on operations in flight (the
//     server's and each identity's share: OVERLOADED beyond them), the
//     store's metrics, and the outcomes readiness counts;
//  3. backendStore: the store as its package made it, with the optional
//     capabilities it has.
//
// Each decorator is a proxyStore: it implements storage.Store and every
// optional capability, decorating the record operations (Claim, Complete,
// Release, Extend, Park, Lookup, the batches, and the admin operations) and
// passing the rest through untouched: Ping, Close, the claim key, the usage
// counts and the sweeper are no request's record operation (a ping must see
// the store as it is, not as the in-flight queue is; the quota refresh and
// the claim key are read once in a while, not per call). Whether a
// capability is there is the backend's to say, not the decorators': ask the
// chain (storeChain.admin, claimKeys, usageCounter).
//
// Health (the ping and the readiness probe) and the parked records gauge
// call the backend itself: they are not calls of a request, and must be
// neither refused as overload nor counted by readiness.

// proxyStore is one decorator of the chain.
type proxyStore interface {
	storage.Store
	storage.Admin
	storage.Batcher
	storage.Sweeper
	storage.ClaimKeys
	storage.UsageCounter
	// Unwrap returns the store the decorator wraps.
	Unwrap() storage.Store
}

// storeChain is the store as the services call it: the outermost decorator,
// and the backend below them all.
type storeChain struct {
	proxyStore
	backend storage.Store
}

// chainConfig configures the decorators of a chain.
type chainConfig struct {
	// maxInFlight bounds the operations in flight; perIdentity those of
	// each identity, when it is less.
	maxInFlight, perIdentity int
	metrics                  *metrics
	// outcomes counts the calls that reached the store, for readiness.
	outcomes *callOutcomes
}

// newStoreChain builds the chain on backend: the one place where the store
// is wrapped.
func newStoreChain(backend storage.Store, cfg chainConfig) (storeChain, error) {
	observed, err := newObservedStore(newBackendStore(backend), cfg.maxInFlight, cfg.perIdentity, cfg.metrics, cfg.outcomes)
	if err != nil {
		return storeChain{}, err
	}
	return storeChain{proxyStore: marginStore{next: observed}, backend: backend}, nil
}

// admin is the chain as a storage.Admin, nil when the backend cannot
// administer records.
func (c storeChain) admin() storage.Admin {
	if _, ok := c.backend.(storage.Admin); !ok {
		return nil
	}
	return c.proxyStore
}

// claimKeys is the chain as a storage.ClaimKeys, nil when the backend keeps
// no claim key.
func (c storeChain) claimKeys() storage.ClaimKeys {
	if _, ok := c.backend.(storage.ClaimKeys); !ok {
		return nil
	}
	return c.proxyStore
}

// usageCounter is the chain as a storage.UsageCounter, nil when the
// backend cannot count usage.
func (c storeChain) usageCounter() storage.UsageCounter {
	if _, ok := c.backend.(storage.UsageCounter); !ok {
		return nil
	}
	return c.proxyStore
}

// errNoCapability answers a call of a capability the backend lacks; the
// chain says it is absent, so only a bug makes one (INTERNAL).
var errNoCapability = fmt.Errorf("server: the store lacks the capability: %w", errors.ErrUnsupported)

// backendStore is the bottom of the chain: the backend, its optional
// capabilities found once. Batches fall back to one call after the other
// (storage.ClaimBatch) on a backend that is no Batcher.
type backendStore struct {
	storage.Store
	admin   storage.Admin
	sweeper storage.Sweeper
	keys    storage.ClaimKeys
	usage   storage.UsageCounter
}

var _ proxyStore = backendStore{}

func newBackendStore(s storage.Store) backendStore {
	b := backendStore{Store: s}
	b.admin, _ = s.(storage.Admin)
	b.sweeper, _ = s.(storage.Sweeper)
	b.keys, _ = s.(storage.ClaimKeys)
	b.usage, _ = s.(storage.UsageCounter)
	return b
}

func (b backendStore) Unwrap() storage.Store { return b.Store }

func (b backendStore) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	return storage.ClaimBatch(ctx, b.Store, ps)
}

func (b backendStore) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	return storage.CompleteBatch(ctx, b.Store, ps)
}

func (b backendStore) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	if b.admin == nil {
		return storage.InspectResult{}, errNoCapability
	}
	return b.admin.Inspect(ctx, k)
}

func (b backendStore) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	if b.admin == nil {
		return storage.Record{}, errNoCapability
	}
	return b.admin.Invalidate(ctx, p)
}

func (b backendStore) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	if b.admin == nil {
		return storage.Record{}, errNoCapability
	}
	return b.admin.Resolve(ctx, p)
}

func (b backendStore) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	if b.admin == nil {
		return storage.ListResult{}, errNoCapability
	}
	return b.admin.List(ctx, p)
}

func (b backendStore) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	if b.admin == nil {
		return nil, errNoCapability
	}
	return b.admin.CountParked(ctx, prefix)
}

func (b backendStore) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	if b.sweeper == nil {
		return storage.SweepResult{}, errNoCapability
	}
	return b.sweeper.SweepExpired(ctx, limit)
}

func (b backendStore) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	if b.sweeper == nil {
		return time.Time{}, time.Time{}, false, errNoCapability
	}
	return b.sweeper.OldestExpiry(ctx)
}

func (b backendStore) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	if b.keys == nil {
		return storage.ClaimKeyRing{}, errNoCapability
	}
	return b.keys.ClaimKeyRing(ctx)
}

func (b backendStore) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	if b.keys == nil {
		return storage.ClaimKeyRing{}, errNoCapability
	}
	return b.keys.RotateClaimKey(ctx, p)
}

func (b backendStore) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	if b.usage == nil {
		return nil, errNoCapability
	}
	return b.usage.ConsumerUsage(ctx, consumers)
}
