package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric/noop"

	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/admission"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/replicas"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/server/internal/waiting"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// Service implements idemregv1.RegistryServiceServer on a storage.Store.
type Service struct {
	idemregv1.UnimplementedRegistryServiceServer
	statuses
	// store is the chain around the backend (server/internal/storechain),
	// which the AdminService shares.
	store  *storechain.Chain
	limits Limits
	// policies are the set in force, which gives each consumer its lease
	// and retention bounds.
	policies func() *policy.Set
	secrets  *claimsecret.Secrets
	waiters  *waiting.Hub
	recheck  time.Duration // DefaultWaitRecheck
	// quotas follow the usage of the consumers with a quota (quota.go).
	quotas *quota.Quotas
	// admission refuses Claims while the heap is near its limit
	// (server/internal/admission); nil refuses none.
	admission *admission.Admission
	metrics   *metrics
	// replicas are the replicas sharing the store (shareWith): told when
	// an attempt their Claims wait on ends, and dividing the quotas; nil
	// is a replica alone.
	replicas *replicas.Replicas
}

// NewService returns the registry service on store, wrapped in the chain
// New builds (server/internal/storechain) with the default bounds and no metrics; every
// consumer gets the lease and retention bounds of limits. It fails when
// limits contradict each other.
func NewService(store storage.Store, limits Limits, logger *slog.Logger) (*Service, error) {
	m, err := newMetrics(noop.NewMeterProvider())
	if err != nil {
		return nil, err
	}
	chain, err := storechain.New(store, storechain.Config{MaxInFlight: DefaultMaxInFlight, PerIdentity: DefaultMaxInFlight, Meter: m.meter})
	if err != nil {
		return nil, err
	}
	return newService(chain, limits, nil, logger, m, serviceBounds{})
}

// serviceBounds are the service's own bounds on what callers make a
// replica hold; zero fields take the defaults.
type serviceBounds struct {
	// maxWaiters (DefaultMaxWaiters) and, of each identity, maxWaitersPerIdentity
	// (DefaultWaitShare of maxWaiters) bound the Claims waiting at once;
	// recheck is how often a waiter looks for changes made through other
	// replicas (DefaultWaitRecheck).
	maxWaiters, maxWaitersPerIdentity int
	recheck                           time.Duration
	// maxQuotaConsumersPerIdentity bounds the consumers with a quota
	// followed for each identity (DefaultMaxQuotaConsumersPerIdentity).
	maxQuotaConsumersPerIdentity int
	// claimKeyRefresh is how often the claim keys are re-read
	// (claimsecret.DefaultRefresh); now is the clock their activation and
	// grace are compared with (time.Now).
	claimKeyRefresh time.Duration
	now             func() time.Time
	// admission refuses Claims near the memory limit; nil refuses none.
	admission *admission.Admission
}

// waitersPerIdentity is the share of maxWaiters each identity may hold.
func (b serviceBounds) waitersPerIdentity(maxWaiters int) int {
	if b.maxWaitersPerIdentity > 0 {
		return b.maxWaitersPerIdentity
	}
	return max(1, int(float64(maxWaiters)*DefaultWaitShare))
}

// newService builds the service on the store chain. policies, when set,
// give each consumer its bounds in place of those of limits.
func newService(store *storechain.Chain, limits Limits, policies func() *policy.Set, logger *slog.Logger, m *metrics, b serviceBounds) (*Service, error) {
	if err := limits.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if policies == nil {
		set, err := policy.NewSet(limits.Policy())
		if err != nil {
			return nil, err
		}
		policies = func() *policy.Set { return set }
	}
	now := b.now
	if now == nil {
		now = time.Now
	}
	secrets, perProcess := claimsecret.New(store.ClaimKeys(), now, cmp.Or(b.claimKeyRefresh, claimsecret.DefaultRefresh), logger)
	if perProcess {
		logger.Warn("server: the store keeps no claim key; claim secrets are valid in this process only", "store", fmt.Sprintf("%T", store.Backend()))
	}
	maxWaiters := cmp.Or(b.maxWaiters, DefaultMaxWaiters)
	s := &Service{store: store, limits: limits, policies: policies, secrets: secrets,
		waiters: waiting.NewHub(maxWaiters, b.waitersPerIdentity(maxWaiters)), recheck: cmp.Or(b.recheck, DefaultWaitRecheck),
		metrics: m, statuses: statuses{logger: logger}, admission: b.admission}
	s.quotas = quota.New(store.UsageCounter(), func(c string) policy.Policy { return s.policies().For(c) },
		cmp.Or(b.maxQuotaConsumersPerIdentity, DefaultMaxQuotaConsumersPerIdentity), logger)
	if err := s.quotas.Instrument(m.meter); err != nil {
		return nil, err
	}
	return s, nil
}

// policyFor returns the policy of consumer for the request of ctx: from the
// config the request was admitted under (configSnapshot), so that its
// identity, rate limits and policy all come from one file, else the
// policy in force.
func (s *Service) policyFor(ctx context.Context, consumer string) policy.Policy {
	if snap, ok := ctx.Value(configKey{}).(*configSnapshot); ok {
		return snap.policy.For(consumer)
	}
	return s.policies().For(consumer)
}

// Claim implements RegistryServiceServer.
func (s *Service) Claim(ctx context.Context, req *idemregv1.ClaimRequest) (*idemregv1.ClaimResponse, error) {
	p, wait, err := s.validateClaim(ctx, req)
	if err != nil {
		return nil, err
	}
	// Read before the claim, so that no claim is acquired without an
	// answer that proves it; and before the quota reserves anything, so
	// that nothing is left to give back when it fails.
	key, err := s.secrets.Issuer(ctx)
	if err != nil {
		return nil, s.toStatus(ctx, "Claim", p.Key, err)
	}
	if err := s.admission.RefuseClaim(); err != nil {
		return nil, s.toStatus(ctx, "Claim", p.Key, err)
	}
	r, err := s.quotas.Admit(ctx, s.store, identityName(ctx), s.policyFor(ctx, p.Consumer), p)
	if err != nil {
		return nil, s.toStatus(ctx, "Claim", p.Key, err)
	}
	res, err := s.claim(ctx, p, wait, r)
	return s.claimResponse(ctx, "Claim", key.Key, p, res, err)
}

// claimResponse is the answer to a Claim the store decided (res, err),
// with the claim secret under key when acquired.
func (s *Service) claimResponse(ctx context.Context, method string, key []byte, p storage.ClaimParams, res storage.ClaimResult, err error) (*idemregv1.ClaimResponse, error) {
	if err != nil {
		return nil, s.toStatus(ctx, method, p.Key, err)
	}
	acquired := res.Outcome == storage.OutcomeAcquired
	rec, err := toRecord(res.Record, acquired)
	if err != nil {
		return nil, s.toStatus(ctx, method, p.Key, err)
	}
	out := &idemregv1.ClaimResponse{Outcome: idemregv1.Outcome(res.Outcome), Record: rec}
	switch res.Outcome {
	case storage.OutcomeAcquired:
		out.Token = res.Record.Token
		out.ClaimSecret = claimsecret.Derive(key, p.Key, res.Record.Token)
	case storage.OutcomeInProgress:
		out.RetryAfter = durationpb.New(res.RetryAfter)
	}
	return out, nil
}

// Complete implements RegistryServiceServer.
func (s *Service) Complete(ctx context.Context, req *idemregv1.CompleteRequest) (*idemregv1.CompleteResponse, error) {
	p, err := s.validateComplete(req)
	if err != nil {
		return nil, err
	}
	var waiters []string
	rec, err := s.fenced(ctx, "Complete", p.Key, p.Token, req.GetClaimSecret(), func() (storage.Record, error) {
		got, err := s.store.Complete(ctx, p)
		waiters = got.Waiters
		return got, err
	})
	if err != nil {
		return nil, err
	}
	s.quotas.Completed(p)
	s.ended(p.Key, waiters)
	return &idemregv1.CompleteResponse{Record: rec}, nil
}

// Release implements RegistryServiceServer.
func (s *Service) Release(ctx context.Context, req *idemregv1.ReleaseRequest) (*idemregv1.ReleaseResponse, error) {
	p, err := s.validateRelease(req)
	if err != nil {
		return nil, err
	}
	var waiters []string
	rec, err := s.fenced(ctx, "Release", p.Key, p.Token, req.GetClaimSecret(), func() (storage.Record, error) {
		got, err := s.store.Release(ctx, p)
		waiters = got.Waiters
		return got, err
	})
	if err != nil {
		return nil, err
	}
	s.ended(p.Key, waiters)
	return &idemregv1.ReleaseResponse{Record: rec}, nil
}

// Extend implements RegistryServiceServer.
func (s *Service) Extend(ctx context.Context, req *idemregv1.ExtendRequest) (*idemregv1.ExtendResponse, error) {
	p, err := s.validateExtend(ctx, req)
	if err != nil {
		return nil, err
	}
	rec, err := s.fenced(ctx, "Extend", p.Key, p.Token, req.GetClaimSecret(), func() (storage.Record, error) {
		rec, err := s.store.Extend(ctx, p)
		if errors.Is(err, storage.ErrLeaseTotalExceeded) {
			// The token the store checked is the record's, so it dates
			// the attempt as the store did.
			err = &leaseTotalExceeded{max: p.MaxLeaseTotal, notAfter: storage.AcquiredAt(p.Token).Add(p.MaxLeaseTotal),
				source: s.policyFor(ctx, p.Consumer).Source}
		}
		return rec, err
	})
	if err != nil {
		return nil, err
	}
	return &idemregv1.ExtendResponse{Record: rec}, nil
}

// Park implements RegistryServiceServer.
func (s *Service) Park(ctx context.Context, req *idemregv1.ParkRequest) (*idemregv1.ParkResponse, error) {
	p, err := s.validatePark(req)
	if err != nil {
		return nil, err
	}
	var waiters []string
	rec, err := s.fenced(ctx, "Park", p.Key, p.Token, req.GetClaimSecret(), func() (storage.Record, error) {
		got, err := s.store.Park(ctx, p)
		waiters = got.Waiters
		return got, err
	})
	if err != nil {
		return nil, err
	}
	// Claims waiting for the key answer OUTCOME_PARKED now.
	s.ended(p.Key, waiters)
	return &idemregv1.ParkResponse{Record: rec}, nil
}

// Lookup implements RegistryServiceServer.
func (s *Service) Lookup(ctx context.Context, req *idemregv1.LookupRequest) (*idemregv1.LookupResponse, error) {
	k, err := s.validateLookup(req)
	if err != nil {
		return nil, err
	}
	got, err := s.store.Lookup(ctx, k)
	if err != nil {
		return nil, s.toStatus(ctx, "Lookup", k, err)
	}
	rec, err := toRecord(got, false)
	if err != nil {
		return nil, s.toStatus(ctx, "Lookup", k, err)
	}
	return &idemregv1.LookupResponse{Record: rec}, nil
}

// fenced runs a token-fenced store call once the caller proved, with the
// claim's secret, that a Claim gave it the token; so the record comes back
// with it.
func (s *Service) fenced(ctx context.Context, method string, k storage.Key, token int64, secret []byte, call func() (storage.Record, error)) (*idemregv1.Record, error) {
	if err := s.secrets.Check(ctx, k, token, secret); err != nil {
		return nil, s.toStatus(ctx, method, k, err)
	}
	got, err := call()
	if err != nil {
		return nil, s.toStatus(ctx, method, k, err)
	}
	rec, err := toRecord(got, true)
	if err != nil {
		return nil, s.toStatus(ctx, method, k, err)
	}
	return rec, nil
}

// shareWith makes the service one of r's replicas: each takes its share
// of the consumers' quotas from the live members, and tells the others
// when an attempt their Claims wait on ends. Call it before serving.
func (s *Service) shareWith(r *replicas.Replicas) {
	s.replicas = r
	s.quotas.ShareWith(r.Count)
}

// claimKeys are the claim keys: the claim secrets' and the peers'
// messages'.
func (s *Service) claimKeys() *claimsecret.Secrets { return s.secrets }

// wake wakes this replica's Claims waiting on k.
func (s *Service) wake(k storage.Key) { s.waiters.Notify(k) }

// ended wakes the waiters on k: this replica's at once, and those of the
// replicas that marked the record (waiters, from the answer of the call
// that ended the attempt), without waiting for them.
func (s *Service) ended(k storage.Key, waiters []string) {
	s.waiters.Notify(k)
	s.replicas.Tell(k, waiters)
}

// run runs the service's loops (the quotas' refresh every quotaRefresh)
// until ctx ends.
func (s *Service) run(ctx context.Context, quotaRefresh time.Duration) {
	s.quotas.Run(ctx, quotaRefresh)
}

// waiting reports how many Claims wait asleep for their key.
func (s *Service) waiting() int { return s.waiters.Waiting() }

// drain ends every wait, now and to come: waiting Claims answer as they are.
func (s *Service) drain() { s.waiters.Drain() }
