// Package quota keeps the consumers' quotas (max_records, max_bytes of
// their policies) for the service: the live replicas sharing a store share
// each quota, each taking its part of what is left.
//
// A consumer whose policy sets max_records or max_bytes may keep that many
// live records, or records of that many bytes (storage.RecordBytes), across
// the service. Knowing costs the hot path nothing: no counter row is
// written per Claim and no count is read per Claim. Instead, each replica
//   - follows the consumers with a quota that it has seen Claim, at most
//     MaxQuotaConsumersPerIdentity of them for each identity (the one whose
//     Claim it saw first), and forgets one none of whose Claims it admitted
//     for QuotaIdleRefreshes refreshes; every QuotaRefresh it counts their
//     live records and bytes in the store (storage.UsageCounter: one
//     statement, or one prefix scan per consumer, over those consumers'
//     records only), a count every replica on the store reads alike;
//   - reserves, for every Claim it admits, one record and the Claim's
//     bytes before the Claim goes to the store, and turns the reservation
//     into the record the Claim created (or drops it) when the store
//     answers: so the Claims in flight count, and Claims decided at the
//     same time (a batch's items, concurrent batches) cannot all see the
//     same count;
//   - adds the results its own Completes store, in memory;
//   - counts what it added since the last count n times over, n being the
//     live replicas (ShareWith, from the membership): so each of n
//     replicas admits at most 1/n of what the quota had left at the count,
//     and the n together at most all of it, whichever replicas a caller's
//     Claims reach;
//   - refuses a Claim of a consumer at or over a quota, with
//     RESOURCE_EXHAUSTED (QUOTA_EXCEEDED) and a QuotaFailure, when the key
//     has no live record: only such a consumer's Claims pay a Lookup first,
//     so that Claims of its existing keys (replays, in progress, takeovers)
//     and Complete, Release and Extend keep working.
//
// A consumer with a quota is never admitted unchecked: one that this
// replica cannot follow, because its identity already has its share of
// followed consumers, is treated as at its quota (its live keys work, new
// keys are refused), so that an identity inventing consumer names under its
// prefix only ever stops its own.
//
// The quota is soft across time, not within one replica's Claims. A
// consumer seen for the first time (after a restart, or after it was
// forgotten) counts as empty until the count its first Claim asks for
// answers, so until then this replica may pass it by up to one share;
// counts made at different moments on different replicas let a race
// overshoot by part of a share (125 of 100 at most seen with two
// replicas); Claims that all reach one replica get 1/n of what is left per
// refresh interval. A count errs toward refusing: a Claim whose record the
// count read while it was still reserved or just added counts twice until
// the next refresh. max_bytes is checked at Claim time only: the Complete
// that stores a large result is never refused, so a consumer may pass
// max_bytes by the results of the records it holds in progress.
package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// DefaultRefresh is how often a replica counts the usage of the
// consumers with a quota.
const DefaultRefresh = 30 * time.Second

// DefaultMaxConsumersPerIdentity bounds the consumers with a quota
// one replica follows for one identity (Config.MaxQuotaConsumersPerIdentity):
// their usage is counted in one statement per refresh, so the bound keeps
// that statement, and the memory of the usage, in proportion to the
// identities of the config file. Only an identity that invents consumer
// names under a prefix reaches it, and then only its own new consumers are
// refused.
const DefaultMaxConsumersPerIdentity = 10000

// IdleRefreshes is how many refreshes a followed consumer may go
// without a Claim admitted through this replica before the next refresh
// forgets it: what an identity's invented consumers hold of its share ends
// with their Claims, and a forgotten consumer is counted again when seen.
const IdleRefreshes = 10

// Quotas follows the usage of the consumers with a quota.
type Quotas struct {
	// counter is nil when the store cannot count: quotas are then not
	// enforced, with a warning.
	counter storage.UsageCounter
	// policyFor is a consumer's policy in force, for dropping consumers
	// whose quota a reload removed.
	policyFor func(consumer string) policy.Policy
	logger    *slog.Logger
	// perIdentity bounds the consumers followed for each identity.
	perIdentity int64

	consumers sync.Map // consumer → *usage
	// followed counts the consumers followed for each identity; names come
	// from the config file, so the map stays as small as its identities.
	followed sync.Map // identity name → *atomic.Int64
	// epoch counts the periodic refreshes: the clock of idleness.
	epoch atomic.Int64
	// replicas counts the live replicas sharing the quotas (ShareWith);
	// nil is one.
	replicas func() int
	// wake asks the loop to count the consumers of fresh now: they were
	// seen first. Nil in tests that refresh by hand (a send to it never
	// happens).
	wake    chan struct{}
	freshMu sync.Mutex
	fresh   []string
	// refreshMu serialises refreshes, so that the last one to start is the
	// last one to apply its count.
	refreshMu         sync.Mutex
	refreshed, failed atomic.Int64
	running           atomic.Bool
	warnedNoCounter   atomic.Bool
	warnedFull        sync.Map // identity name → struct{}: warned once
}

// usage is what a replica knows of one consumer: the store's count at the
// last refresh, less what this replica had added when the count began,
// plus what this replica added, plus what its Claims in flight reserved.
// Adding never takes a lock; reserving takes the consumer's, so that two
// Claims cannot both take the last record of a quota.
type usage struct {
	name string
	// owner is the identity charged for following the consumer.
	owner                    string
	baseRecords, baseBytes   atomic.Int64
	addedRecords, addedBytes atomic.Int64
	// countedRecords and countedBytes are what this replica had added when
	// the last count began (zero before the first): what it added since is
	// added less these, the part of its usage a share of the quota bounds.
	countedRecords, countedBytes atomic.Int64
	// seen is the epoch of the last Claim admitted.
	seen atomic.Int64
	// uncounted is set until the first Claim that saw the consumer asked
	// for a refresh.
	uncounted atomic.Bool

	mu                             sync.Mutex
	reservedRecords, reservedBytes int64
	// forgotten is set when a refresh stopped following the consumer: a
	// Claim that found it just before must follow it afresh.
	forgotten bool
}

func (u *usage) records() int64 { return u.baseRecords.Load() + u.addedRecords.Load() }
func (u *usage) bytes() int64   { return u.baseBytes.Load() + u.addedBytes.Load() }

// shared is what this replica counts against a quota when n live replicas
// share the consumer: the store's last count, plus n times what it added
// (and reserved) since. Each replica may so add at most 1/n of what the
// quota had left at the count, and the n together at most all of it,
// whichever replicas a caller's Claims reach. With n = 1 it is records()
// plus reserved (bytes alike). u.mu is held.
func (u *usage) shared(n int64) (records, bytes int64) {
	countR, countB := u.countedRecords.Load(), u.countedBytes.Load()
	sinceR := u.addedRecords.Load() - countR + u.reservedRecords
	sinceB := u.addedBytes.Load() - countB + u.reservedBytes
	return u.baseRecords.Load() + countR + n*sinceR, u.baseBytes.Load() + countB + n*sinceB
}

// Reservation is what one admitted Claim holds of its consumer's quota
// until the store answers it: one record and the Claim's bytes, or nothing
// for a Claim of a live key admitted at the quota.
type Reservation struct {
	u              *usage
	records, bytes int64
}

// New follows usage with counter (nil when the store cannot count) under
// the policies policyFor gives, at most perIdentity consumers for each
// identity.
func New(counter storage.UsageCounter, policyFor func(consumer string) policy.Policy, perIdentity int, logger *slog.Logger) *Quotas {
	return &Quotas{counter: counter, policyFor: policyFor, perIdentity: int64(perIdentity), logger: logger, wake: make(chan struct{}, 1)}
}

// ShareWith makes q take its share of each quota with the live replicas
// that replicas counts (this one included), rather than the whole quota
// less what it knows of the others' Claims. Call it before the first
// Admit.
func (q *Quotas) ShareWith(replicas func() int) { q.replicas = replicas }

// live is the number of live replicas sharing the quotas, at least 1.
func (q *Quotas) live() int64 {
	if q.replicas == nil {
		return 1
	}
	return int64(max(q.replicas(), 1))
}

// Exceeded is the refusal of a Claim of a new key for a consumer at or
// over a quota, or for one this replica cannot follow (MaxConsumers set).
type Exceeded struct {
	// Consumer is the consumer refused, Source where its policy comes from.
	Consumer, Source string
	// MaxRecords is zero when max_records is not what was reached.
	MaxRecords, Records int64
	// MaxBytes is zero when max_bytes is not what was reached.
	MaxBytes, Bytes int64
	// Identity already has MaxConsumers consumers followed, when set.
	Identity     string
	MaxConsumers int64
	// Replicas is the number of live replicas sharing the quota, when
	// more than one: this replica was at its share of what was left.
	Replicas int64
}

// Reason is the reason it is answered with (server/internal/reason).
func (e *Exceeded) Reason() idemregv1.ErrorReason {
	return idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED
}

func (e *Exceeded) Error() string {
	return fmt.Sprintf("consumer %q is at its quota", e.Consumer)
}

// errNotFollowed: the identity already has its share of followed
// consumers.
var errNotFollowed = errors.New("the identity has its share of consumers followed")

// claimBytes are the bytes of the record a Claim of p creates, as
// storage.RecordBytes counts them.
func claimBytes(p storage.ClaimParams) int64 {
	return int64(len(p.Consumer) + len(p.Key.Key) + len(p.Fingerprint) + len(p.Holder) + len(p.RequestID))
}

// Admit decides whether a Claim of p, by the identity named owner (the one
// charged for following a consumer it is the first to Claim), may go to
// the store under pol, and reserves what it may create. The reservation must be given to claimed
// once the store answered (or the Claim was given up); nil when the
// consumer has no quota.
func (q *Quotas) Admit(ctx context.Context, store Lookuper, owner string, pol policy.Policy, p storage.ClaimParams) (*Reservation, error) {
	if !pol.HasQuota() {
		return nil, nil
	}
	if q.counter == nil {
		if !q.warnedNoCounter.Swap(true) {
			q.logger.WarnContext(ctx, "quotas not enforced: the store cannot count usage", "consumer", p.Consumer) // validated before Admit
		}
		return nil, nil
	}
	for {
		u, err := q.follow(ctx, p.Consumer, owner)
		if err != nil {
			// Fail closed: a consumer not followed is at its quota.
			return nil, q.atQuota(ctx, store, p.Key, &Exceeded{Consumer: p.Consumer, Source: pol.Source, Identity: owner, MaxConsumers: q.perIdentity})
		}
		u.mu.Lock()
		if u.forgotten {
			u.mu.Unlock()
			continue
		}
		if epoch := q.epoch.Load(); u.seen.Load() != epoch {
			u.seen.Store(epoch)
		}
		n := q.live()
		e := &Exceeded{Consumer: p.Consumer, Source: pol.Source}
		if n > 1 {
			e.Replicas = n
		}
		sr, sb := u.shared(n)
		if pol.MaxRecords > 0 && sr >= pol.MaxRecords {
			e.MaxRecords, e.Records = pol.MaxRecords, u.records()+u.reservedRecords
		}
		if pol.MaxBytes > 0 && sb >= pol.MaxBytes {
			e.MaxBytes, e.Bytes = pol.MaxBytes, u.bytes()+u.reservedBytes
		}
		if e.MaxRecords == 0 && e.MaxBytes == 0 {
			r := &Reservation{u: u, records: 1, bytes: claimBytes(p)}
			u.reservedRecords += r.records
			u.reservedBytes += r.bytes
			u.mu.Unlock()
			return r, nil
		}
		u.mu.Unlock()
		if err := q.atQuota(ctx, store, p.Key, e); err != nil {
			return nil, err
		}
		return &Reservation{u: u}, nil
	}
}

// atQuota lets a Claim of a consumer at its quota go on with a key that
// has a live record, which adds none; it returns e for a new key.
func (q *Quotas) atQuota(ctx context.Context, store Lookuper, k storage.Key, e *Exceeded) error {
	switch _, err := store.Lookup(ctx, k); {
	case err == nil:
		return nil
	case errors.Is(err, storage.ErrNotFound):
		return e
	default:
		return err
	}
}

// follow returns the usage of consumer, following it from now on, charged
// to owner when it was not followed yet; errNotFollowed when owner has
// its share of followed consumers.
func (q *Quotas) follow(ctx context.Context, consumer, owner string) (*usage, error) {
	if v, ok := q.consumers.Load(consumer); ok {
		return v.(*usage), nil
	}
	n := q.followedBy(owner)
	if n.Add(1) > q.perIdentity {
		n.Add(-1)
		if _, warned := q.warnedFull.LoadOrStore(owner, struct{}{}); !warned {
			q.logger.WarnContext(ctx, "quota: new keys refused for consumers beyond the identity's share of consumers followed",
				"identity", owner, "max", q.perIdentity, "consumer", consumer)
		}
		return nil, errNotFollowed
	}
	seen := &usage{name: consumer, owner: owner}
	seen.uncounted.Store(true)
	seen.seen.Store(q.epoch.Load())
	v, loaded := q.consumers.LoadOrStore(consumer, seen)
	if loaded {
		n.Add(-1)
	}
	return v.(*usage), nil
}

func (q *Quotas) followedBy(owner string) *atomic.Int64 {
	v, ok := q.followed.Load(owner)
	if !ok {
		v, _ = q.followed.LoadOrStore(owner, new(atomic.Int64))
	}
	return v.(*atomic.Int64)
}

// forget stops following u unless a Claim holds a reservation on it (keep
// set): it is then kept until a later refresh. It reports whether u was
// forgotten.
func (q *Quotas) forget(u *usage, keep bool) bool {
	u.mu.Lock()
	if keep && (u.reservedRecords != 0 || u.reservedBytes != 0) {
		u.mu.Unlock()
		return false
	}
	u.forgotten = true
	u.mu.Unlock()
	if q.consumers.CompareAndDelete(u.name, u) {
		q.followedBy(u.owner).Add(-1)
	}
	return true
}

// Claimed is called with the store's answer to a Claim admitted with r
// (each decision of a waiting Claim, or the error that gave it up): it
// adds the record the Claim created, if it did, gives back what r
// reserved, and asks for a count of a consumer seen for the first time,
// now that its Claim is in the store.
func (q *Quotas) Claimed(r *Reservation, res storage.ClaimResult, err error) {
	if r == nil {
		return
	}
	u := r.u
	// The record is added before its reservation is given back, so that
	// no admit in between sees neither; and before the count is asked
	// for, so that a count that read it also sees it added.
	if err == nil && res.Outcome == storage.OutcomeAcquired && !res.Repeated && res.Record.Attempt == 1 {
		u.addedRecords.Add(1)
		u.addedBytes.Add(storage.RecordBytes(&res.Record))
	}
	if r.records != 0 || r.bytes != 0 {
		u.mu.Lock()
		u.reservedRecords -= r.records
		u.reservedBytes -= r.bytes
		u.mu.Unlock()
		r.records, r.bytes = 0, 0
	}
	if u.uncounted.Load() && u.uncounted.Swap(false) && q.wake != nil {
		// Count it soon rather than at the next tick: it and the others
		// seen first meanwhile, not every consumer, so that a burst of
		// new consumers (after a restart) costs one count of theirs.
		q.freshMu.Lock()
		q.fresh = append(q.fresh, u.name)
		q.freshMu.Unlock()
		select {
		case q.wake <- struct{}{}:
		default:
		}
	}
}

// Completed adds a stored result to its consumer's usage, if followed.
func (q *Quotas) Completed(p storage.CompleteParams) {
	if v, ok := q.consumers.Load(p.Consumer); ok {
		v.(*usage).addedBytes.Add(int64(len(p.Result)))
	}
}

// Refresh counts the usage of the consumers followed, and stops following
// those whose policy has no quota any more and those idle for
// IdleRefreshes refreshes. On a store failure every consumer keeps the
// usage it had, and the failure is logged.
func (q *Quotas) Refresh(ctx context.Context) error {
	if q.counter == nil {
		return nil
	}
	q.refreshMu.Lock()
	defer q.refreshMu.Unlock()
	epoch := q.epoch.Add(1)
	var names []string
	q.consumers.Range(func(_, v any) bool {
		u := v.(*usage)
		switch {
		case !q.policyFor(u.name).HasQuota():
			q.forget(u, false)
		case epoch-u.seen.Load() > IdleRefreshes && q.forget(u, true):
		default:
			names = append(names, u.name)
		}
		return true
	})
	return q.count(ctx, names)
}

// refreshFresh counts the consumers seen first since the last call.
func (q *Quotas) refreshFresh(ctx context.Context) error {
	q.freshMu.Lock()
	names := q.fresh
	q.fresh = nil
	q.freshMu.Unlock()
	q.refreshMu.Lock()
	defer q.refreshMu.Unlock()
	return q.count(ctx, names)
}

// count sets the usage of names from the store's count; refreshMu held.
func (q *Quotas) count(ctx context.Context, names []string) error {
	if len(names) == 0 {
		q.refreshed.Add(1)
		return nil
	}
	// What this replica added before the count began is in the count
	// (a Claim adds after the store answered it); what it adds from now
	// on may be too, and then counts twice until the next refresh, which
	// errs toward refusing rather than admitting.
	type before struct {
		u              *usage
		records, bytes int64
	}
	was := make([]before, len(names))
	for i, name := range names {
		if v, ok := q.consumers.Load(name); ok {
			u := v.(*usage)
			was[i] = before{u: u, records: u.addedRecords.Load(), bytes: u.addedBytes.Load()}
		}
	}
	counts, err := q.counter.ConsumerUsage(ctx, names)
	if err != nil {
		q.failed.Add(1)
		q.logger.Warn("quota refresh failed; consumers keep the usage last known", "consumers", len(names), "error", err)
		return err
	}
	for i, name := range names {
		w := was[i]
		if w.u == nil {
			continue
		}
		c := counts[name]
		w.u.baseRecords.Store(c.Records - w.records)
		w.u.baseBytes.Store(c.Bytes - w.bytes)
		w.u.countedRecords.Store(w.records)
		w.u.countedBytes.Store(w.bytes)
	}
	q.refreshed.Add(1)
	return nil
}

// Run refreshes every interval, and when a consumer is first seen, until
// ctx ends.
func (q *Quotas) Run(ctx context.Context, interval time.Duration) {
	if q.counter == nil {
		return
	}
	q.running.Store(true)
	defer q.running.Store(false)
	t := time.NewTicker(interval)
	defer t.Stop()
	// A count may take longer than a short interval (a test's, or a busy
	// store's): bounded by the interval alone, every count of a 1 ms
	// interval timed out on a loaded machine and the usage never
	// refreshed. A slow count makes the ticker drop ticks instead.
	timeout := max(interval, minRefreshTimeout)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			rctx, cancel := context.WithTimeout(ctx, timeout)
			_ = q.Refresh(rctx) // logged; the usage last known stays
			cancel()
		case <-q.wake:
			rctx, cancel := context.WithTimeout(ctx, timeout)
			_ = q.refreshFresh(rctx)
			cancel()
		}
	}
}

// minRefreshTimeout is the least time a count is given.
const minRefreshTimeout = 5 * time.Second

// Lookuper is what Admit needs of the store: whether a key has a live
// record (storage.Store's Lookup).
type Lookuper interface {
	Lookup(ctx context.Context, k storage.Key) (storage.Record, error)
}

// MetricRefreshes counts this replica's counts of the usage of the
// consumers it follows (every refresh interval, and when a consumer is
// first seen), by result: ok, or failed (the usage last known kept).
const MetricRefreshes = "idemreg.quota.refreshes"

// Instrument reports the refreshes on meter (MetricRefreshes), read from
// Stats when the meter is collected: nothing on the hot path.
func (q *Quotas) Instrument(meter metric.Meter) error {
	c, err := meter.Int64ObservableCounter(MetricRefreshes, metric.WithUnit("{count}"),
		metric.WithDescription("Counts of the usage of the consumers with a quota that this replica follows (every --quota-refresh, and when a consumer is first seen), by result: ok, or failed (the usage last known kept)."))
	if err != nil {
		return fmt.Errorf("quota: metrics: %w", err)
	}
	ok := metric.WithAttributeSet(attribute.NewSet(attribute.String("result", "ok")))
	failed := metric.WithAttributeSet(attribute.NewSet(attribute.String("result", "failed")))
	if _, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		done, fails, _ := q.Stats()
		o.ObserveInt64(c, done, ok)
		o.ObserveInt64(c, fails, failed)
		return nil
	}, c); err != nil {
		return fmt.Errorf("quota: metrics: %w", err)
	}
	return nil
}

// Stats reports the refreshes so far, done and failed, and whether the
// refresh loop runs.
func (q *Quotas) Stats() (done, failed int64, running bool) {
	return q.refreshed.Load(), q.failed.Load(), q.running.Load()
}

// Usage is what this replica knows of consumer's usage; ok is false when
// it does not follow the consumer.
func (q *Quotas) Usage(consumer string) (records, bytes int64, ok bool) {
	v, ok := q.consumers.Load(consumer)
	if !ok {
		return 0, 0, false
	}
	u := v.(*usage)
	return u.records(), u.bytes(), true
}

// WithoutWake keeps the refresh loop from counting a consumer as soon as
// it is first seen, so that counts come from Refresh calls alone (tests).
// Call it before Run.
func (q *Quotas) WithoutWake() { q.wake = nil }
