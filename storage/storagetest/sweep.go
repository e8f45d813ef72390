package storagetest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// sweeperCases are the cases of the storage.Sweeper capability. Unlike
// the Store area's cases, these count what a sweep deletes, so each needs
// an empty store of its own.
var sweeperCases = []testCase[storage.Sweeper]{
	{"OldestExpiry", testOldestExpiry},
	{"Horizon", testSweepHorizon},
	{"LiveRecordsKept", testSweepKeepsLive},
	{"LimitAndOrder", testSweepLimit},
	{"ReclaimedKept", testSweepReclaimed},
	{"ParkedKeptUntilItsRetentionEnds", testSweepParked},
	{"RaceSweepVersusClaim", testRaceSweepVersusClaim},
	{"RaceTwoSweepers", testRaceTwoSweepers},
}

func oldestExpiry(t *testing.T, sw storage.Sweeper) (oldest, now time.Time, ok bool) {
	t.Helper()
	oldest, now, ok, err := sw.OldestExpiry(t.Context())
	require.NoError(t, err)
	require.False(t, now.IsZero(), "OldestExpiry reports the store's clock")
	return oldest, now, ok
}

func sweep(t *testing.T, sw storage.Sweeper, limit int) storage.SweepResult {
	t.Helper()
	res, err := sw.SweepExpired(t.Context(), limit)
	require.NoError(t, err)
	require.False(t, res.Now.IsZero(), "SweepExpired reports its horizon")
	return res
}

// sweepAll sweeps in batches of limit until a short batch, as the retention
// loop does, and returns the batch sizes.
func sweepAll(ctx context.Context, sw storage.Sweeper, limit int) ([]int, error) {
	var batches []int
	for {
		res, err := sw.SweepExpired(ctx, limit)
		if err != nil {
			return batches, err
		}
		batches = append(batches, res.Deleted)
		if res.Deleted < limit {
			return batches, nil
		}
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

func testOldestExpiry(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	_, _, ok := oldestExpiry(t, sw)
	require.False(t, ok, "an empty store has no oldest expiry")

	p := claimParams(newKey(storage.KindMessage), "")
	first := acquire(t, s, p)
	p = claimParams(newKey(storage.KindMessage), "")
	p.Retention = 2 * retention
	acquire(t, s, p)

	oldest, now, ok := oldestExpiry(t, sw)
	require.True(t, ok)
	require.True(t, first.ExpiresAt.Equal(oldest), "oldest %v, want %v", oldest, first.ExpiresAt)
	require.False(t, now.Before(first.CreatedAt), "the clock reading is no earlier than the record's creation")

	c.Advance(lease + retention + time.Minute)
	oldest, now, ok = oldestExpiry(t, sw)
	require.True(t, ok, "an expired record still counts until it is swept")
	require.True(t, first.ExpiresAt.Equal(oldest))
	require.True(t, now.After(first.ExpiresAt), "the clock reading includes the clock's advance")

	res := sweep(t, sw, 100)
	require.Equal(t, 1, res.Deleted)
	c.Advance(retention)
	res = sweep(t, sw, 100)
	require.Equal(t, 1, res.Deleted)
	_, _, ok = oldestExpiry(t, sw)
	require.False(t, ok)
}

// testSweepHorizon checks that a sweep's horizon is exactly its clock
// reading: every record that expired by then is deleted, however recently,
// and every record expiring after it is kept, however soon.
//
// A store's clock keeps running between the calls of a test, so the test
// cannot set the horizon to the microsecond. It makes records whose
// expiries lie a millisecond or more apart, moves the clock so that the next
// sweep lands between two of them, and then checks the outcome against the
// horizon the sweep reports, which holds whatever the scheduling delay was.
// Far-off records keep both sides of the horizon populated even if the
// delay is long.
func testSweepHorizon(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	const dense = 16
	var expiries []time.Time
	add := func(ret time.Duration) {
		p := claimParams(newKey(storage.KindOperation), "")
		p.Retention = ret
		expiries = append(expiries, acquire(t, s, p).ExpiresAt)
	}
	add(time.Minute) // long expired at the horizon
	for i := range dense {
		add(retention + time.Duration(i)*time.Millisecond)
	}
	add(2 * retention) // far from the horizon
	require.True(t, slices.IsSortedFunc(expiries, func(a, b time.Time) int { return a.Compare(b) }))
	for i := 2; i < 1+dense; i++ {
		require.GreaterOrEqual(t, expiries[i].Sub(expiries[i-1]), time.Millisecond)
	}

	// Aim half-way between the 4th and 5th dense records from a fresh
	// reading of the store's clock.
	below, above := expiries[4], expiries[5]
	target := below.Add(above.Sub(below) / 2)
	_, now, _ := oldestExpiry(t, sw)
	c.Advance(target.Sub(now))

	res := sweep(t, sw, 1000)
	var expired int
	for _, e := range expiries {
		if !e.After(res.Now) {
			expired++
		}
	}
	require.GreaterOrEqual(t, expired, 5, "the horizon %v fell before the target %v", res.Now, target)
	require.Less(t, expired, len(expiries), "the far-off record expired: the clock moved by more than an hour")
	require.Equal(t, expired, res.Deleted, "deleted exactly the records with expires_at <= the horizon %v", res.Now)

	oldest, _, ok := oldestExpiry(t, sw)
	require.True(t, ok)
	require.True(t, expiries[expired].Equal(oldest),
		"the first record expiring after the horizon is kept: oldest %v, want %v", oldest, expiries[expired])
	t.Logf("horizon %v: newest deleted expired %v before it, oldest kept expires %v after it",
		res.Now, res.Now.Sub(expiries[expired-1]), expiries[expired].Sub(res.Now))
}

// testSweepKeepsLive checks that a record with a live lease, or one whose
// lease was extended past its former expiry, is never deleted.
func testSweepKeepsLive(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	k := newKey(storage.KindOperation)
	p := claimParams(k, "fp")
	p.Lease = time.Hour
	p.Retention = time.Millisecond
	rec := acquire(t, s, p)

	c.Advance(time.Hour - time.Second) // the lease has a second left
	require.Zero(t, sweep(t, sw, 100).Deleted)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, rec, got)

	ext, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: rec.Token, Lease: time.Hour})
	require.NoError(t, err)
	require.True(t, ext.ExpiresAt.After(rec.ExpiresAt))
	c.Advance(time.Minute) // past the expiry the record had before the Extend
	require.Zero(t, sweep(t, sw, 100).Deleted, "an extended record is kept")
	got, err = s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, ext, got)

	// A lease that ran out keeps the record for its retention.
	k2 := newKey(storage.KindOperation)
	acquire(t, s, claimParams(k2, "fp"))
	c.Advance(lease + time.Second)
	require.Zero(t, sweep(t, sw, 100).Deleted)
	_, err = s.Lookup(t.Context(), k2)
	require.NoError(t, err)

	c.Advance(time.Hour + time.Minute) // both expired now
	require.Equal(t, 2, sweep(t, sw, 100).Deleted)
	_, _, ok := oldestExpiry(t, sw)
	require.False(t, ok)
}

// testSweepLimit checks that a sweep deletes at most its limit, oldest
// expiry first, so that batches end with a short one.
func testSweepLimit(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	var recs []storage.Record
	for i := range 10 {
		p := claimParams(newKey(storage.KindMessage), "")
		p.Retention = retention + time.Duration(i)*time.Second
		recs = append(recs, acquire(t, s, p))
	}
	live := claimParams(newKey(storage.KindMessage), "")
	live.Retention = 3 * retention
	acquire(t, s, live)
	c.Advance(lease + retention + time.Minute)

	res := sweep(t, sw, 4)
	require.Equal(t, 4, res.Deleted)
	oldest, _, ok := oldestExpiry(t, sw)
	require.True(t, ok)
	require.True(t, recs[4].ExpiresAt.Equal(oldest), "the oldest expiries go first")

	batches, err := sweepAll(t.Context(), sw, 4)
	require.NoError(t, err)
	require.Equal(t, []int{4, 2}, batches, "full batches, then a short one")
	require.Zero(t, sweep(t, sw, 4).Deleted)
	require.Zero(t, sweep(t, sw, 0).Deleted, "a zero limit deletes nothing")

	_, err = s.Lookup(t.Context(), live.Key)
	require.NoError(t, err, "the live record is kept")
}

// testSweepReclaimed checks that a record claimed again after it expired is
// a live record the sweeper keeps.
func testSweepReclaimed(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, "fp-1"))
	complete(t, s, k, first.Token, "r")
	other := newKey(storage.KindMessage)
	acquire(t, s, claimParams(other, ""))
	c.Advance(lease + retention + time.Minute)

	second := acquire(t, s, claimParams(k, "fp-2"))
	require.Equal(t, 1, sweep(t, sw, 100).Deleted, "only the record nobody claimed again")
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, second, got)
}

// testRaceSweepVersusClaim races sweeps against claims of the expired
// records they delete: whichever comes first, every claim that acquired
// leaves a live record with its token.
func testRaceSweepVersusClaim(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	for range 3 {
		keys := make([]storage.Key, 12)
		for i := range keys {
			keys[i] = newKey(storage.KindOperation)
			acquire(t, s, claimParams(keys[i], ""))
		}
		c.Advance(lease + retention + time.Minute)

		type answer struct {
			rec     storage.Record
			deleted []int
			err     error
		}
		answers := parallel(len(keys)+2, func(i int) answer {
			if i >= len(keys) {
				deleted, err := sweepAll(context.Background(), sw, 3)
				return answer{deleted: deleted, err: err}
			}
			p := claimParams(keys[i], "")
			p.Lease = time.Hour
			res, err := s.Claim(context.Background(), p)
			if err == nil && res.Outcome != storage.OutcomeAcquired {
				err = fmt.Errorf("claim of an expired record answered %v", res.Outcome)
			}
			return answer{rec: res.Record, err: err}
		})
		deleted := 0
		for i, a := range answers {
			require.NoError(t, a.err)
			if i >= len(keys) {
				deleted += sum(a.deleted)
				continue
			}
			got, err := s.Lookup(t.Context(), keys[i])
			require.NoError(t, err, "a record claimed during a sweep was deleted")
			requireSame(t, a.rec, got)
		}
		require.LessOrEqual(t, deleted, len(keys))
		require.Zero(t, sweep(t, sw, 100).Deleted, "every record is live again")

		c.Advance(time.Hour + retention + time.Minute)
		batches, err := sweepAll(t.Context(), sw, 100)
		require.NoError(t, err)
		require.Equal(t, len(keys), sum(batches))
	}
}

// testRaceTwoSweepers races two sweepers over the same expired records:
// together they delete each exactly once.
func testRaceTwoSweepers(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	const n = 40
	for range 3 {
		for range n {
			acquire(t, s, claimParams(newKey(storage.KindMessage), ""))
		}
		c.Advance(lease + retention + time.Minute)

		type answer struct {
			batches []int
			err     error
		}
		answers := parallel(2, func(int) answer {
			batches, err := sweepAll(context.Background(), sw, 7)
			return answer{batches, err}
		})
		total := 0
		for _, a := range answers {
			require.NoError(t, a.err)
			total += sum(a.batches)
		}
		require.Equal(t, n, total, "batches %v and %v", answers[0].batches, answers[1].batches)
		_, _, ok := oldestExpiry(t, sw)
		require.False(t, ok)
	}
}

// testSweepParked: a parked record is not swept while parked, until its
// retention from the parking has passed; then it is swept like any expired
// record, and the key's next token still exceeds the parked record's.
func testSweepParked(t *testing.T, s storage.Store, sw storage.Sweeper, c *Clock) {
	k := newKey(storage.KindOperation)
	acquire(t, s, atMost(claimParams(k, "fp"), 1))
	c.Advance(lease + time.Second)
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	parked := requireParked(t, res, err)

	c.Advance(retention - time.Minute)
	require.Zero(t, sweep(t, sw, 100).Deleted, "a parked record within its retention is kept")
	res, err = s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	requireParked(t, res, err)

	c.Advance(2 * time.Minute)
	require.Equal(t, 1, sweep(t, sw, 100).Deleted, "swept once its retention ended")
	fresh := acquire(t, s, atMost(claimParams(k, "fp"), 1))
	require.EqualValues(t, 1, fresh.Attempt)
	require.Greater(t, fresh.Token, parked.Token, "the token floor outlives the parked record")
}
