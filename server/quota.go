package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// Quotas.
//
// A consumer whose policy sets max_records or max_bytes may keep that many
// live records, or records of that many bytes (storage.RecordBytes), as far
// as the server knows. Knowing costs the hot path nothing: no counter row
// is written per Claim and no count is read per Claim. Instead, each
// replica
//   - follows the consumers with a quota that it has seen Claim (at most
//     MaxQuotaConsumers), and every QuotaRefresh counts their live records
//     and bytes in the store (storage.UsageCounter: one statement, or one
//     prefix scan per consumer, over those consumers' records only);
//   - adds to that count the records its own Claims create, and the results
//     its own Completes store, in memory;
//   - refuses a Claim of a consumer at or over a quota, with
//     RESOURCE_EXHAUSTED (QUOTA_EXCEEDED) and a QuotaFailure, when the key
//     has no live record: only such a consumer's Claims pay a Lookup first,
//     so that Claims of its existing keys (replays, in progress, takeovers)
//     and Complete, Release and Extend keep working.
//
// The quota is soft. A consumer seen for the first time counts as empty
// until the refresh its first Claim asks for answers; Claims on other
// replicas are known here only at the next refresh; Claims decided at the
// same time all see the same count (a BatchClaim's items too); a Claim that
// commits while a refresh counts may be missed until the next one. So a
// consumer may overshoot by the new keys it Claims through the other
// replicas in one refresh interval, plus those in flight at once; not for
// longer, since each refresh counts what the store holds. The count is the database's, shared by every
// replica on it. max_bytes is checked at Claim time only: the Complete that
// stores a large result is never refused, so a consumer may pass max_bytes
// by the results of the records it holds in progress.

// DefaultQuotaRefresh is how often a replica counts the usage of the
// consumers with a quota.
const DefaultQuotaRefresh = 30 * time.Second

// MaxQuotaConsumers bounds the consumers with a quota one replica follows:
// their usage is counted in one statement per refresh. A consumer beyond it
// is not held to its quota on that replica (and a warning says so), which
// only an identity that invents consumer names under a prefix can cause.
const MaxQuotaConsumers = 10000

// quotas follows the usage of the consumers with a quota.
type quotas struct {
	// counter is nil when the store cannot count: quotas are then not
	// enforced, with a warning.
	counter storage.UsageCounter
	// policies is the set in force, for dropping consumers whose quota a
	// reload removed.
	policies func() *policy.Set
	logger   *slog.Logger

	consumers sync.Map // consumer → *usage
	n         atomic.Int64
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
	warnedTooMany     atomic.Bool
}

// usage is what a replica knows of one consumer: the store's count at the
// last refresh, less what this replica had added when it applied it, plus
// what this replica added. Adding never takes a lock.
type usage struct {
	name                     string
	baseRecords, baseBytes   atomic.Int64
	addedRecords, addedBytes atomic.Int64
	// uncounted is set until the first Claim that saw the consumer asked
	// for a refresh.
	uncounted atomic.Bool
}

func (u *usage) records() int64 { return u.baseRecords.Load() + u.addedRecords.Load() }
func (u *usage) bytes() int64   { return u.baseBytes.Load() + u.addedBytes.Load() }

// newQuotas follows usage with counter, nil when the store cannot count.
func newQuotas(counter storage.UsageCounter, policies func() *policy.Set, logger *slog.Logger) *quotas {
	return &quotas{counter: counter, policies: policies, logger: logger, wake: make(chan struct{}, 1)}
}

// quotaExceeded: a Claim of a new key for a consumer at or over a quota.
type quotaExceeded struct {
	consumer, source    string
	maxRecords, records int64 // maxRecords zero when not exceeded
	maxBytes, bytes     int64 // maxBytes zero when not exceeded
}

func (e *quotaExceeded) Error() string {
	return fmt.Sprintf("consumer %q is at its quota", e.consumer)
}

// admit decides whether a Claim of k may go to the store under pol. It
// returns the consumer's usage to add the Claim's new record to, nil when
// the consumer has no quota.
func (q *quotas) admit(ctx context.Context, store storage.Store, pol policy.Policy, k storage.Key) (*usage, error) {
	if !pol.HasQuota() {
		return nil, nil
	}
	if q.counter == nil {
		if !q.warnedNoCounter.Swap(true) {
			q.logger.WarnContext(ctx, "quotas not enforced: the store cannot count usage", "consumer", echo(k.Consumer))
		}
		return nil, nil
	}
	u := q.follow(ctx, k.Consumer)
	if u == nil {
		return nil, nil
	}
	e := &quotaExceeded{consumer: k.Consumer, source: pol.Source}
	if r := u.records(); pol.MaxRecords > 0 && r >= pol.MaxRecords {
		e.maxRecords, e.records = pol.MaxRecords, r
	}
	if b := u.bytes(); pol.MaxBytes > 0 && b >= pol.MaxBytes {
		e.maxBytes, e.bytes = pol.MaxBytes, b
	}
	if e.maxRecords == 0 && e.maxBytes == 0 {
		return u, nil
	}
	// At the quota, a Claim may still go on with a key that has a live
	// record: it adds none.
	switch _, err := store.Lookup(ctx, k); {
	case err == nil:
		return u, nil
	case errors.Is(err, storage.ErrNotFound):
		return nil, e
	default:
		return nil, err
	}
}

// follow returns the usage of consumer, following it from now on; nil
// when the replica follows MaxQuotaConsumers already.
func (q *quotas) follow(ctx context.Context, consumer string) *usage {
	if v, ok := q.consumers.Load(consumer); ok {
		return v.(*usage)
	}
	if q.n.Load() >= MaxQuotaConsumers {
		if !q.warnedTooMany.Swap(true) {
			q.logger.WarnContext(ctx, "quotas not enforced for more consumers: this replica follows the most it may", "max", MaxQuotaConsumers, "consumer", echo(consumer))
		}
		return nil
	}
	seen := &usage{name: consumer}
	seen.uncounted.Store(true)
	v, loaded := q.consumers.LoadOrStore(consumer, seen)
	if !loaded {
		q.n.Add(1)
	}
	return v.(*usage)
}

// claimed is called once the store answered a Claim admitted with u: it
// adds the record the Claim created, if it did, and asks for a count of a
// consumer seen for the first time, now that its Claim is in the store.
func (q *quotas) claimed(u *usage, res storage.ClaimResult, err error) {
	if u == nil {
		return
	}
	// The record is added before the count is asked for: a count that read
	// it must also see it in addedRecords, or it would count it twice
	// (once in the base, once added).
	if err == nil && res.Outcome == storage.OutcomeAcquired && !res.Repeated && res.Record.Attempt == 1 {
		u.addedRecords.Add(1)
		u.addedBytes.Add(storage.RecordBytes(&res.Record))
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

// completed adds a stored result to its consumer's usage, if followed.
func (q *quotas) completed(p storage.CompleteParams) {
	if v, ok := q.consumers.Load(p.Consumer); ok {
		v.(*usage).addedBytes.Add(int64(len(p.Result)))
	}
}

// refresh counts the usage of the consumers followed, and stops following
// those whose policy has no quota any more. On a store failure every
// consumer keeps the usage it had, and the failure is logged.
func (q *quotas) refresh(ctx context.Context) error {
	if q.counter == nil {
		return nil
	}
	q.refreshMu.Lock()
	defer q.refreshMu.Unlock()
	set := q.policies()
	var names []string
	q.consumers.Range(func(k, _ any) bool {
		name := k.(string)
		if !set.For(name).HasQuota() {
			q.consumers.Delete(name)
			q.n.Add(-1)
			return true
		}
		names = append(names, name)
		return true
	})
	return q.count(ctx, names)
}

// refreshFresh counts the consumers seen first since the last call.
func (q *quotas) refreshFresh(ctx context.Context) error {
	q.freshMu.Lock()
	names := q.fresh
	q.fresh = nil
	q.freshMu.Unlock()
	q.refreshMu.Lock()
	defer q.refreshMu.Unlock()
	return q.count(ctx, names)
}

// count sets the usage of names from the store's count; refreshMu held.
func (q *quotas) count(ctx context.Context, names []string) error {
	if len(names) == 0 {
		q.refreshed.Add(1)
		return nil
	}
	counts, err := q.counter.ConsumerUsage(ctx, names)
	if err != nil {
		q.failed.Add(1)
		q.logger.Warn("quota refresh failed; consumers keep the usage last known", "consumers", len(names), "error", err)
		return err
	}
	for _, name := range names {
		v, ok := q.consumers.Load(name)
		if !ok {
			continue
		}
		// What this replica added so far is in the count (a Claim adds
		// after the store answered it), bar the Claims that committed
		// after the count's snapshot: those are missed until the next
		// refresh, which errs toward admitting.
		u, c := v.(*usage), counts[name]
		u.baseRecords.Store(c.Records - u.addedRecords.Load())
		u.baseBytes.Store(c.Bytes - u.addedBytes.Load())
	}
	q.refreshed.Add(1)
	return nil
}

// run refreshes every interval, and when a consumer is first seen, until
// ctx ends.
func (q *quotas) run(ctx context.Context, interval time.Duration) {
	if q.counter == nil {
		return
	}
	q.running.Store(true)
	defer q.running.Store(false)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			rctx, cancel := context.WithTimeout(ctx, interval)
			_ = q.refresh(rctx) // logged; the usage last known stays
			cancel()
		case <-q.wake:
			rctx, cancel := context.WithTimeout(ctx, interval)
			_ = q.refreshFresh(rctx)
			cancel()
		}
	}
}
