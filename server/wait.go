package server

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/server/internal/waiting"
	"github.com/idemreg/idemreg/storage"
)

// A Claim with a wait (server/internal/waiting) that finds the key in
// progress under another holder's live lease waits for a reason to decide
// again rather than answering OUTCOME_IN_PROGRESS at once.

// Bounds of waiting.
const (
	// MaxWait is the longest wait a Claim may ask for.
	MaxWait = 30 * time.Second
	// DefaultMaxWaiters is how many Claims may wait at once on a replica.
	DefaultMaxWaiters = 10000
	// DefaultWaitShare is the share of MaxWaiters one identity may hold by
	// default: half, as for the store's slots (DefaultInFlightShare), so
	// that a tenant holding every wait it may still leaves half to the
	// others.
	DefaultWaitShare = 0.5
	// DefaultWaitRecheck is how often a waiter looks at the record for
	// changes made through other replicas.
	DefaultWaitRecheck = 100 * time.Millisecond
)

// tenant is the identity whose shares the request of ctx takes (of the
// waiters, of the store's slots in flight, of the calls in progress):
// its identity's name, none (empty) for the anonymous caller of an open
// server, which is every caller and not a tenant.
func tenant(ctx context.Context) string {
	if id, ok := IdentityFrom(ctx); ok && id != nil && id != access.Anonymous {
		return id.Name
	}
	return ""
}

// waitEnd is when a wait of d that starts now must answer: at d, and no
// later than the store's deadline margin before the request's deadline,
// so that the answer reaches the caller before the deadline does.
func waitEnd(ctx context.Context, d time.Duration) time.Time {
	end := time.Now().Add(d)
	if dl, ok := storechain.Deadline(ctx); ok && dl.Before(end) {
		end = dl
	}
	return end
}

// claim decides p, waiting up to wait while the key is in progress; r,
// what its admission reserved of the consumer's quota, is settled by
// every decision.
func (s *Service) claim(ctx context.Context, p storage.ClaimParams, wait time.Duration, r *quota.Reservation) (storage.ClaimResult, error) {
	if wait <= 0 {
		return s.decide(p, r)(ctx)
	}
	start := time.Now()
	c := s.waitingClaim(ctx, p, wait, r)
	res, err, o := s.waiters.Claim(ctx, c)
	s.waited(ctx, c, start, o)
	return res, err
}

// decide is one decision of a Claim of p admitted with r: the store's,
// with its answer settling the reservation.
func (s *Service) decide(p storage.ClaimParams, r *quota.Reservation) func(context.Context) (storage.ClaimResult, error) {
	return func(ctx context.Context) (storage.ClaimResult, error) {
		res, err := s.store.Claim(ctx, p)
		s.quotas.Claimed(r, res, err)
		return res, err
	}
}

// waitingClaim is a Claim of p that may wait up to wait.
func (s *Service) waitingClaim(ctx context.Context, p storage.ClaimParams, wait time.Duration, r *quota.Reservation) waiting.Claim {
	return waiting.Claim{Key: p.Key, Share: tenant(ctx), End: waitEnd(ctx, wait), Recheck: s.recheck,
		Decide: s.decide(p, r), Lookup: s.store.Lookup, Mark: s.replicas.MarkFor(p.Key)}
}

// waited records how a wait that began at start went.
func (s *Service) waited(ctx context.Context, c waiting.Claim, start time.Time, o waiting.Outcome) {
	if o.Refused != "" {
		refused := []attribute.KeyValue{attribute.String("bound", o.Refused)}
		if o.Refused == waiting.BoundIdentity {
			refused = append(refused, attribute.String("identity", c.Share))
		}
		s.metrics.waitsRefused.Add(ctx, 1, attrs(refused...))
	}
	if o.Ended != "" {
		d := attrs(attribute.String("ended", o.Ended))
		s.metrics.waits.Add(ctx, 1, d)
		s.metrics.waitDuration.Record(ctx, time.Since(start).Seconds(), d)
	}
}
