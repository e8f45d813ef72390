// Package storechain is the store as a request calls it: one decorator
// over the backend, built once by New and used by the RegistryService and
// the AdminService alike (SpiceDB's internal/datastore/proxy is the model).
//
// Every record operation (Claim, Complete, Release, Extend, Park, Lookup,
// the batches, and the admin operations) goes through Chain.do, which in
// this order:
//
//  1. gives the call the request's deadline less a margin (Deadline), so
//     that a silent store is answered STORE_UNAVAILABLE while the client
//     still waits, rather than the client's deadline turning the call into
//     a bare DEADLINE_EXCEEDED;
//  2. bounds the operations in flight, the server's and each identity's
//     share (OVERLOADED beyond them, at once: overload is answered rather
//     than queued behind the store's connection pool until deadlines run
//     out);
//  3. measures the call (idemreg.store.duration, idemreg.store.errors, the
//     Claim outcomes, lease_lost) and counts its outcome for readiness
//     (Config.Outcome);
//  4. opens a child span of the caller's (trace.go), when the caller's
//     span is recording.
//
// What is no request's record operation passes through untouched: Ping,
// Close, the claim key, the usage counts and the sweeper (a ping must see
// the store as it is, not as the in-flight queue is; the quota refresh and
// the claim key are read once in a while, not per call). Whether a
// capability is there is the backend's to say (Admin, ClaimKeys,
// UsageCounter). Health and the parked records gauge call the backend
// itself: they are no calls of a request, and must be neither refused as
// overload nor counted by readiness.
package storechain

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemreg/idemreg/storage"
)

// Config configures a Chain.
type Config struct {
	// MaxInFlight bounds the record operations in flight; PerIdentity those
	// of each identity, when it is less.
	MaxInFlight, PerIdentity int
	// Meter makes the instruments (the server's scope).
	Meter metric.Meter
	// Identity is the identity whose share a call of ctx takes, empty for
	// none (the anonymous caller of an open server is every caller, not a
	// tenant).
	Identity func(ctx context.Context) string
	// Outcome is told the error (nil: answered) of every record operation
	// that reached the store, for readiness; nil for none.
	Outcome func(err error)
	// Tracer opens the store span of each record operation whose caller's
	// span is recording (trace.go); nil for none.
	Tracer trace.Tracer
}

// Chain is the store as the services call it.
type Chain struct {
	b        backend
	sem      chan struct{}
	shares   *identityShares // nil when an identity may take every slot
	m        *instruments
	identity func(context.Context) string
	outcome  func(error)
	tracer   trace.Tracer // nil: no store spans
}

var (
	_ storage.Store        = (*Chain)(nil)
	_ storage.Admin        = (*Chain)(nil)
	_ storage.Batcher      = (*Chain)(nil)
	_ storage.MixedBatcher = (*Chain)(nil)
	_ storage.Sweeper      = (*Chain)(nil)
	_ storage.ClaimKeys    = (*Chain)(nil)
	_ storage.UsageCounter = (*Chain)(nil)
)

// New builds the chain on store: the one place where the store is wrapped.
func New(store storage.Store, cfg Config) (*Chain, error) {
	m, err := newInstruments(cfg.Meter)
	if err != nil {
		return nil, err
	}
	c := &Chain{b: newBackend(store), sem: make(chan struct{}, cfg.MaxInFlight), m: m,
		identity: cfg.Identity, outcome: cfg.Outcome, tracer: cfg.Tracer}
	if cfg.PerIdentity < cfg.MaxInFlight {
		c.shares = &identityShares{share: cfg.PerIdentity}
	}
	if c.identity == nil {
		c.identity = func(context.Context) string { return "" }
	}
	if c.outcome == nil {
		c.outcome = func(error) {}
	}
	m.zero(context.Background())
	// The in-flight gauge is read off the bound when metrics are
	// collected, which costs the calls nothing.
	if _, err := cfg.Meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		obs.ObserveInt64(m.inFlight, int64(len(c.sem)))
		return nil
	}, m.inFlight); err != nil {
		return nil, fmt.Errorf("storechain: metrics: %w", err)
	}
	return c, nil
}

// Backend is the store below the chain.
func (c *Chain) Backend() storage.Store { return c.b.Store }

// Admin is the chain as a storage.Admin, nil when the backend cannot
// administer records.
func (c *Chain) Admin() storage.Admin {
	if c.b.admin == nil {
		return nil
	}
	return c
}

// ClaimKeys is the chain as a storage.ClaimKeys, nil when the backend
// keeps no claim key.
func (c *Chain) ClaimKeys() storage.ClaimKeys {
	if c.b.keys == nil {
		return nil
	}
	return c
}

// UsageCounter is the chain as a storage.UsageCounter, nil when the
// backend cannot count usage.
func (c *Chain) UsageCounter() storage.UsageCounter {
	if c.b.usage == nil {
		return nil
	}
	return c
}

// Bounds of the part of a request's remaining time kept back from the
// store: a tenth of it, between these.
const (
	MinDeadlineMargin = 20 * time.Millisecond
	MaxDeadlineMargin = time.Second
)

// Deadline is the request's deadline (ctx's) less the margin kept back from
// the store; false when the request has none. A wait that must answer
// before the request's deadline ends there too.
func Deadline(ctx context.Context) (time.Time, bool) {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Time{}, false
	}
	return d.Add(-min(max(time.Until(d)/10, MinDeadlineMargin), MaxDeadlineMargin)), true
}

// storeContext is ctx with the store's deadline (Deadline).
func storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := Deadline(ctx)
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithDeadline(ctx, d)
}
