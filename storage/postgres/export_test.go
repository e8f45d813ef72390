package postgres

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// ClaimSQL is the Claim statement, for the plan test.
var ClaimSQL = claimSQL

// BatchStats reports how many transactions of more than one item the
// store sent and how many items they carried.
func BatchStats(s *Store) (batches, calls int64) {
	return s.q.batches.Load(), s.q.batchedItems.Load()
}

// MixedBatches reports how many of those transactions held both Claims and
// Completes.
func MixedBatches(s *Store) int64 { return s.q.mixed.Load() }

// BatchSplits reports how many batches were split after a serialization
// failure or a deadlock.
func BatchSplits(s *Store) int64 { return s.q.splits.Load() }

// Coalescing reports the transactions in flight and the items queued.
func Coalescing(s *Store) (inFlight, queued int) {
	q := s.q
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.inFlight, len(q.pending) + len(q.deferred)
}

// StaleReads reports how many statements (or batch members) ran again
// because their pre-image was older than the row they declined to write.
func StaleReads(s *Store) int64 { return s.staleReads.Load() }

// MemberSplits reports how many batches were split after the database
// refused one member's input, and the most parameter bytes one batched
// statement carried.
func MemberSplits(s *Store) (splits, largestBytes int64) {
	return s.q.memberSplits.Load(), s.q.largestBytes.Load()
}

// Row runs one single-row statement of the store and returns its answer:
// whether it wrote, the statement's clock, and the record it returned
// (written, or the pre-image). op is claim, complete, release, extend, park,
// invalidate or resolve, with p of the matching storage params type.
func Row(ctx context.Context, s *Store, op string, p any) (written bool, now time.Time, rec storage.Record, err error) {
	var sql string
	var args []any
	switch p := p.(type) {
	case storage.ClaimParams:
		sql, args = claimSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, nonNil(p.Fingerprint), p.Holder,
			p.Lease.Microseconds(), p.Retention.Microseconds(), s.offsetMicros(), p.RequestID, p.MaxAttempts}
	case storage.CompleteParams:
		sql, args = completeSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Result, s.offsetMicros()}
	case storage.ReleaseParams:
		sql, args = releaseSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros()}
	case storage.ExtendParams:
		sql, args = extendSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Lease.Microseconds(), s.offsetMicros(), p.DefaultLease.Microseconds(), p.MaxLeaseTotal.Microseconds()}
	case storage.ParkParams:
		sql, args = parkSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Reason, s.offsetMicros()}
	case storage.InvalidateParams:
		sql, args = invalidateSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros(), p.Reason}
	case storage.ResolveParams:
		var result []byte
		if p.Complete {
			result = p.Result
		}
		sql, args = resolveSQL, []any{p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Complete, result, p.Reason, s.offsetMicros()}
	default:
		return false, time.Time{}, storage.Record{}, fmt.Errorf("%s: params %T", op, p)
	}
	answers, err := s.queryBatch(ctx, sql, 1, args...)
	if err != nil {
		return false, time.Time{}, storage.Record{}, err
	}
	return answers[0].written, answers[0].now, answers[0].rec, nil
}

// MigrationCount is how many migrations Migrate applies on PostgreSQL.
func MigrationCount() int {
	all, err := migrations(false, false)
	if err != nil {
		panic(err)
	}
	return len(all)
}

// SweepSQL is the sweeper's statement, for the cursor tests.
var SweepSQL = sweepSQL

// OldestExpirySQL is the sweeper's lag read, for the cursor tests.
var OldestExpirySQL = oldestExpirySQL

// ListSQL is the List statement of a scope ("exact", "from" or "range"),
// for the plan test; parked picks the variant that reads the parked index.
func ListSQL(scope string, parked bool) string {
	v := listVariant{parked: parked}
	switch scope {
	case "exact":
		v.scope = scopeExact
	case "from":
		v.scope = scopeFrom
	case "range":
		v.scope = scopeRange
	default:
		panic("scope " + scope)
	}
	return listSQL[v]
}

// CountParkedRangeSQL is CountParked's statement for a prefix with an end,
// for the plan test.
var CountParkedRangeSQL = countParkedRangeSQL

// BackendPID is the process id of the database backend behind the store's
// pool (the benchmarks size it to one connection).
func BackendPID(t testing.TB, s *Store) int {
	var pid int
	if err := s.pool.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// BatchPlans sums, over the batched Claim and Complete statements, the
// generic and custom plans PostgreSQL made for them on the connection
// behind the store's pool (the test sizes it to one connection).
func BatchPlans(t testing.TB, s *Store) (generic, custom int64) {
	err := s.pool.QueryRow(t.Context(), `SELECT COALESCE(sum(generic_plans), 0), COALESCE(sum(custom_plans), 0)
FROM pg_prepared_statements WHERE statement = ANY($1)`, []string{claimBatchSQL, completeBatchSQL}).Scan(&generic, &custom)
	if err != nil {
		t.Fatal(err)
	}
	return generic, custom
}
