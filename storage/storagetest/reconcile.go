package storagetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Reconciliation: the attempt history, an operator's Resolve, List and
// CountParked (storage.Admin, storage.DecideResolve).

var reconcileCases = []testCase[storage.Admin]{
	{"HistoryOfTakeovers", testHistoryOfTakeovers},
	{"HistoryOfOperatorActions", testHistoryOfOperatorActions},
	{"ResolveParkedWithResult", testResolveWithResult},
	{"ResolveParkedRelease", testResolveRelease},
	{"ResolveStuckInProgress", testResolveStuck},
	{"ResolveErrors", testResolveErrors},
	{"ResolveRepairsCompleted", testResolveRepairsCompleted},
	{"RaceResolveVersusResolve", testRaceResolveVersusResolve},
	{"RaceResolveVersusClaim", testRaceResolveVersusClaim},
	{"ListFilters", testListFilters},
	{"ListPrefix", testListPrefix},
	{"ListPaging", testListPaging},
	{"ListPagingUnderConcurrentWrites", testListPagingUnderWrites},
	{"ListBoundedWindowAndParkedIndex", testListBoundedWindow},
	{"CountParked", testCountParked},
}

func keyOf(consumer string, kind storage.Kind, key string) storage.Key {
	return storage.Key{Consumer: consumer, Kind: kind, Key: key}
}

func inspect(t *testing.T, a storage.Admin, k storage.Key) storage.Record {
	t.Helper()
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err)
	return got.Record
}

// parkedRecord acquires k and parks it with reason.
func parkedRecord(t *testing.T, s storage.Store, k storage.Key, reason string) storage.Record {
	t.Helper()
	rec := acquire(t, s, claimParams(k, "fp"))
	return park(t, s, k, rec.Token, reason)
}

// listAll follows List's pages from the start and returns every record,
// failing if the listing does not end within maxPages.
func listAll(t *testing.T, a storage.Admin, p storage.ListParams, maxPages int) []storage.Record {
	t.Helper()
	var out []storage.Record
	for range maxPages {
		page, err := a.List(t.Context(), p)
		require.NoError(t, err)
		require.LessOrEqual(t, len(page.Records), p.Limit, "a page holds at most its limit")
		out = append(out, page.Records...)
		if page.Next == nil {
			return out
		}
		p.After = page.Next
	}
	t.Fatalf("the listing did not end within %d pages", maxPages)
	return nil
}

func keysOf(recs []storage.Record) []storage.Key {
	out := make([]storage.Key, len(recs))
	for i, r := range recs {
		out[i] = r.Key
	}
	return out
}

func compareKeys(a, b storage.Key) int {
	if a.Consumer != b.Consumer {
		if a.Consumer < b.Consumer {
			return -1
		}
		return 1
	}
	if a.Kind != b.Kind {
		return int(a.Kind) - int(b.Kind)
	}
	switch {
	case a.Key < b.Key:
		return -1
	case a.Key > b.Key:
		return 1
	}
	return 0
}

func requireKeyOrder(t *testing.T, recs []storage.Record) {
	t.Helper()
	for i := 1; i < len(recs); i++ {
		require.Negative(t, compareKeys(recs[i-1].Key, recs[i].Key), "listed in key order, each once: %v then %v", recs[i-1].Key, recs[i].Key)
	}
}

// testHistoryOfTakeovers: every takeover keeps the attempt it ended, the
// last MaxHistory of them, and only Inspect (and List) show them.
func testHistoryOfTakeovers(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindOperation)
	prev := acquire(t, s, claimParams(k, "fp"))
	for i := range storage.MaxHistory + 2 {
		c.Advance(lease + time.Second)
		p := claimParams(k, "fp")
		p.Holder = fmt.Sprintf("holder-%d", i)
		res, err := s.Claim(t.Context(), p)
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeAcquired, res.Outcome)
		require.Nil(t, res.Record.History, "a Claim's answer carries no history")

		got := inspect(t, a, k)
		require.Len(t, got.History, min(i+1, storage.MaxHistory))
		last := got.History[len(got.History)-1]
		require.Equal(t, storage.AttemptTakenOver, last.End)
		require.Equal(t, prev.Token, last.Token)
		require.Equal(t, prev.Attempt, last.Attempt)
		require.Equal(t, prev.Holder, last.Holder)
		require.True(t, last.EndedAt.Equal(prev.LeaseExpiresAt), "ended when its lease ended: %v, want %v", last.EndedAt, prev.LeaseExpiresAt)
		require.True(t, last.AcquiredAt().Equal(storage.AcquiredAt(prev.Token)))
		prev = res.Record
	}
	got := inspect(t, a, k)
	require.EqualValues(t, storage.MaxHistory+3, got.Attempt)
	require.EqualValues(t, 3, got.History[0].Attempt, "the oldest entries were dropped")

	// Completing keeps the history; the record expiring and a fresh record
	// of the key start without one.
	complete(t, s, k, prev.Token, "done")
	require.Len(t, inspect(t, a, k).History, storage.MaxHistory)
	c.Advance(retention + time.Second)
	fresh := acquire(t, s, claimParams(k, "fp"))
	require.EqualValues(t, 1, fresh.Attempt)
	require.Empty(t, inspect(t, a, k).History, "a new record of the key has no history")
}

// testHistoryOfOperatorActions: invalidation and resolution keep the attempt
// they ended with the operator's reason and the park reason it had.
func testHistoryOfOperatorActions(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	parked := parkedRecord(t, s, k, "outcome unknown")
	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: parked.Token, Reason: "provider says not charged"})
	require.NoError(t, err)
	require.Nil(t, inv.History, "only Inspect and List return history")

	next := acquire(t, s, claimParams(k, "fp"))
	res, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: next.Token, Complete: true, Result: []byte("r"), Reason: "done by hand"})
	require.NoError(t, err)
	require.Nil(t, res.History)

	h := inspect(t, a, k).History
	require.Len(t, h, 2)
	require.Equal(t, storage.Attempt{Attempt: 1, Token: parked.Token, Holder: parked.Holder, EndedAt: h[0].EndedAt,
		End: storage.AttemptInvalidated, ParkReason: "outcome unknown", Note: "provider says not charged"}, h[0])
	require.Equal(t, storage.Attempt{Attempt: 1, Token: next.Token, Holder: next.Holder, EndedAt: h[1].EndedAt,
		End: storage.AttemptResolvedCompleted, Note: "done by hand"}, h[1])
	require.True(t, h[0].EndedAt.Before(h[1].EndedAt) || h[0].EndedAt.Equal(h[1].EndedAt))
	require.False(t, h[1].EndedAt.Before(storage.AcquiredAt(next.Token)), "ended when the operator acted")
}

// testResolveWithResult: a parked record resolved with a result is
// completed under a fresh token: Claims replay it, its holder is fenced.
func testResolveWithResult(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	parked := parkedRecord(t, s, k, "outcome unknown")
	rec, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: parked.Token, Complete: true, Result: []byte("charged once"), Reason: "checked"})
	require.NoError(t, err)
	require.Equal(t, storage.StateCompleted, rec.State)
	require.Greater(t, rec.Token, parked.Token)
	require.Empty(t, rec.ParkReason)
	require.Equal(t, "charged once", string(rec.Result))
	require.Equal(t, parked.Attempt, rec.Attempt)
	require.Equal(t, "fp", string(rec.Fingerprint))
	require.False(t, rec.CompletedAt.IsZero())
	require.True(t, rec.ExpiresAt.Equal(rec.CompletedAt.Add(parked.Retention)), "kept its retention from the resolution")
	requireSame(t, rec, inspect(t, a, k))

	replay, err := s.Claim(t.Context(), claimParams(k, "fp"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, replay.Outcome)
	require.Equal(t, "charged once", string(replay.Record.Result))
	_, err = s.Claim(t.Context(), claimParams(k, "other"))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: parked.Token, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "the parked holder is fenced out")
}

// testResolveRelease: a record parked at max_attempts, released, is
// acquired by the next Claim as attempt 1 with the same fingerprint, and
// max_attempts counts afresh.
func testResolveRelease(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindMessage)
	acquire(t, s, atMost(claimParams(k, "fp"), 1))
	c.Advance(lease + time.Second)
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	parked := requireParked(t, res, err)

	rel, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: parked.Token, Reason: "fixed the bug"})
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, rel.State)
	require.Zero(t, rel.Attempt)
	require.Empty(t, rel.ParkReason)
	require.Empty(t, rel.Result)
	require.Greater(t, rel.Token, parked.Token)
	require.Equal(t, "fp", string(rel.Fingerprint), "the same operation tried again keeps its fingerprint")

	_, err = s.Claim(t.Context(), atMost(claimParams(k, "other"), 1))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)
	next := acquire(t, s, atMost(claimParams(k, "fp"), 1))
	require.EqualValues(t, 1, next.Attempt)
	require.Greater(t, next.Token, rel.Token)
	c.Advance(lease + time.Second)
	res, err = s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	requireParked(t, res, err) // max_attempts counted afresh: attempt 1 was the one allowed
}

// testResolveStuck: a record in progress under a live lease can be
// resolved; its holder is fenced out and the next Claim acquires at once.
func testResolveStuck(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	stuck := acquire(t, s, claimParams(k, "fp"))
	rel, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: stuck.Token, Reason: "holder is gone"})
	require.NoError(t, err)
	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: stuck.Token, Lease: lease})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: stuck.Token, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	next := acquire(t, s, claimParams(k, "fp"))
	require.EqualValues(t, 1, next.Attempt)
	require.Greater(t, next.Token, rel.Token)
}

// testResolveRepairsCompleted: an operator replaces a completed record's
// result (one that cannot be replayed) with the token they inspected, in
// one step: the record stays completed, keeps its fingerprint and
// attempt, gets a new token, and every later Claim replays the new result.
func testResolveRepairsCompleted(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	p := claimParams(k, "fp")
	rec := acquire(t, s, p)
	done := complete(t, s, k, rec.Token, "undecodable")
	got, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: done.Token, Complete: true, Result: []byte("repaired"), Reason: "stored JSON, OPS-1"})
	require.NoError(t, err)
	require.Equal(t, storage.StateCompleted, got.State)
	require.Greater(t, got.Token, done.Token)
	require.Equal(t, done.Attempt, got.Attempt)
	after := inspect(t, a, k)
	require.Equal(t, "repaired", string(after.Result))
	require.Equal(t, []byte("fp"), after.Fingerprint, "the repaired key still refuses other parameters")
	last := after.History[len(after.History)-1]
	require.Equal(t, storage.AttemptResolvedCompleted, last.End)
	require.Equal(t, "stored JSON, OPS-1", last.Note)
	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)
	require.Equal(t, "repaired", string(res.Record.Result))
	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: done.Token, Complete: true, Result: []byte("again"), Reason: "r"})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "of two operators only the first repairs")
}

func testResolveErrors(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindOperation)
	_, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: 1, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrNotFound)

	rec := acquire(t, s, claimParams(k, ""))
	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: rec.Token + 1, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	requireSame(t, rec, inspect(t, a, k))

	done := complete(t, s, k, rec.Token, "kept")
	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: done.Token, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrAlreadyCompleted, "a completed record is not released (Invalidate drops a result)")
	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: done.Token - 1, Complete: true, Result: []byte("other"), Reason: "r"})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	require.Equal(t, "kept", string(inspect(t, a, k).Result), "a stale token replaces nothing")

	k2 := newKey(storage.KindOperation)
	parked := parkedRecord(t, s, k2, "unknown")
	c.Advance(retention + time.Second)
	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: k2, Token: parked.Token, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrNotFound, "an expired parked record counts as absent")
}

// testRaceResolveVersusResolve: two operators act on the record they both
// inspected: exactly one wins, the other learns someone acted first.
func testRaceResolveVersusResolve(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	for round := range 10 {
		k := newKey(storage.KindOperation)
		parked := parkedRecord(t, s, k, "unknown")
		errs := parallel(2, func(i int) error {
			p := storage.ResolveParams{Key: k, Token: parked.Token, Reason: fmt.Sprint("operator ", i)}
			if (round+i)%2 == 0 {
				p.Complete, p.Result = true, []byte(fmt.Sprint("result ", i))
			}
			_, err := a.Resolve(t.Context(), p)
			return err
		})
		var won int
		for _, err := range errs {
			if err == nil {
				won++
				continue
			}
			require.ErrorIs(t, err, storage.ErrLeaseLost)
		}
		require.Equal(t, 1, won, "round %d: exactly one resolution: %v", round, errs)
		h := inspect(t, a, k).History
		require.Len(t, h, 1, "one attempt ended, once")
	}
}

// testRaceResolveVersusClaim races an operator's release of a record whose
// lease ran out against a Claim that takes it over: either the Claim took
// over first (the operator's token is stale) or the operator released it
// first (the Claim then acquires as attempt 1). Never both acting on the
// same attempt.
func testRaceResolveVersusClaim(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	var resolvedFirst, claimedFirst int
	for round := range 12 {
		k := newKey(storage.KindOperation)
		rec := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		type answer struct {
			res storage.ClaimResult
			err error
		}
		out := parallel(2, func(i int) answer {
			if i == 0 {
				_, err := a.Resolve(t.Context(), storage.ResolveParams{Key: k, Token: rec.Token, Reason: "release"})
				return answer{err: err}
			}
			res, err := s.Claim(t.Context(), claimParams(k, "fp"))
			return answer{res, err}
		})
		require.NoError(t, out[1].err)
		if out[0].err == nil {
			resolvedFirst++
			claimed := out[1].res
			if claimed.Outcome == storage.OutcomeInProgress {
				// The release ended the lease at its own clock reading,
				// which may be a moment after the Claim's (a SQL statement
				// reads the clock when it starts, and may then see a row
				// committed later): at the Claim's instant the lease had
				// that moment left, so it is told to retry after it.
				require.Less(t, claimed.RetryAfter, time.Second, "round %d", round)
				claimed, out[1].err = s.Claim(t.Context(), claimParams(k, "fp"))
				require.NoError(t, out[1].err)
				out[1].res = claimed
			}
			require.Equal(t, storage.OutcomeAcquired, claimed.Outcome, "round %d", round)
			require.EqualValues(t, 1, claimed.Record.Attempt, "round %d: released first, the Claim starts afresh", round)
		} else {
			require.Equal(t, storage.OutcomeAcquired, out[1].res.Outcome, "round %d", round)
			claimedFirst++
			require.ErrorIs(t, out[0].err, storage.ErrLeaseLost, "round %d", round)
			require.EqualValues(t, 2, out[1].res.Record.Attempt, "round %d: taken over first", round)
		}
		got := inspect(t, a, k)
		require.Equal(t, out[1].res.Record.Token, got.Token, "round %d: the Claim's token is current", round)
	}
	t.Logf("resolved first %d, claimed first %d", resolvedFirst, claimedFirst)
}

// testListFilters lists one consumer's records by state, attempt and age.
func testListFilters(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	consumer := newConsumer("list")
	inProgress := acquire(t, s, claimParams(keyOf(consumer, storage.KindMessage, "a"), "fp"))
	done := acquire(t, s, claimParams(keyOf(consumer, storage.KindMessage, "b"), "fp"))
	complete(t, s, done.Key, done.Token, "result")
	parked := parkedRecord(t, s, keyOf(consumer, storage.KindOperation, "c"), "unknown")
	c.Advance(time.Minute)
	retried := acquire(t, s, claimParams(keyOf(consumer, storage.KindOperation, "d"), "fp"))
	c.Advance(lease + time.Second)
	retried = acquire(t, s, claimParams(retried.Key, "fp")) // attempt 2
	// Another consumer whose name extends this one is not listed by the
	// exact name.
	acquire(t, s, claimParams(keyOf(consumer+"x", storage.KindMessage, "a"), "fp"))

	list := func(p storage.ListParams) []storage.Key {
		p.Consumer, p.Limit = consumer, 100
		return keysOf(listAll(t, a, p, 10))
	}
	all := listAll(t, a, storage.ListParams{Consumer: consumer, Limit: 100}, 10)
	require.Equal(t, []storage.Key{inProgress.Key, done.Key, parked.Key, retried.Key}, keysOf(all))
	for _, r := range all {
		require.Empty(t, r.Result, "List leaves results out")
	}
	require.Len(t, all[3].History, 1, "List returns the history")
	require.Equal(t, retried.Token, all[3].Token, "List shows the token an operator resolves with")

	require.Equal(t, []storage.Key{parked.Key}, list(storage.ListParams{State: storage.StateParked}))
	require.Equal(t, []storage.Key{done.Key}, list(storage.ListParams{State: storage.StateCompleted}))
	require.Equal(t, []storage.Key{inProgress.Key, retried.Key}, list(storage.ListParams{State: storage.StateInProgress}))
	require.Equal(t, []storage.Key{retried.Key}, list(storage.ListParams{MinAttempt: 2}))
	require.Equal(t, []storage.Key{inProgress.Key, done.Key, parked.Key}, list(storage.ListParams{OlderThan: 30 * time.Second}),
		"created more than 30 s ago by the store's clock")
	require.Equal(t, []storage.Key{inProgress.Key}, list(storage.ListParams{State: storage.StateInProgress, OlderThan: 30 * time.Second}))

	c.Advance(retention) // past the first three's expiry, not retried's (it was claimed 71 s later)
	require.Equal(t, []storage.Key{retried.Key}, list(storage.ListParams{}), "expired records count as absent")
}

// testListPrefix lists the consumers under a prefix, and only them.
func testListPrefix(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	base := newConsumer("prefix")
	var want []storage.Key
	for _, consumer := range []string{base + ".a", base + ".b", base + ".b.c"} {
		for _, key := range []string{"2", "1"} {
			acquire(t, s, claimParams(keyOf(consumer, storage.KindMessage, key), ""))
			want = append(want, keyOf(consumer, storage.KindMessage, key))
		}
	}
	acquire(t, s, claimParams(keyOf(base+"-other", storage.KindMessage, "1"), ""))
	acquire(t, s, claimParams(keyOf(base, storage.KindMessage, "1"), ""))
	slices.SortFunc(want, compareKeys)

	got := listAll(t, a, storage.ListParams{Consumer: base + ".", Prefix: true, Limit: 4}, 10)
	require.Equal(t, want, keysOf(got))
	got = listAll(t, a, storage.ListParams{Consumer: base, Prefix: true, Limit: 100}, 10)
	require.Len(t, got, len(want)+2, "the prefix matches the consumer itself and its other extensions too")
	requireKeyOrder(t, got)
}

// testListPaging follows pages of every size over one consumer's records.
func testListPaging(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	consumer := newConsumer("paging")
	var want []storage.Key
	for i := range 23 {
		k := keyOf(consumer, storage.Kind(1+i%2), fmt.Sprintf("k%02d", i))
		rec := acquire(t, s, claimParams(k, ""))
		if i%3 == 0 {
			park(t, s, k, rec.Token, "p")
		}
		want = append(want, k)
	}
	slices.SortFunc(want, compareKeys)
	for _, limit := range []int{1, 2, 5, 23, 100} {
		got := listAll(t, a, storage.ListParams{Consumer: consumer, Limit: limit}, 30)
		require.Equal(t, want, keysOf(got), "limit %d", limit)
		parked := listAll(t, a, storage.ListParams{Consumer: consumer, State: storage.StateParked, Limit: limit}, 30)
		require.Len(t, parked, 8, "limit %d", limit)
		requireKeyOrder(t, parked)
	}
	// A page that starts after the last key is empty and ends the listing.
	page, err := a.List(t.Context(), storage.ListParams{Consumer: consumer, Limit: 5, After: &want[len(want)-1]})
	require.NoError(t, err)
	require.Empty(t, page.Records)
	require.Nil(t, page.Next)
}

// testListPagingUnderWrites pages through a consumer's records while other
// records of the same consumer, between and around them, are claimed,
// completed, taken over and parked: every record that exists throughout is
// listed exactly once, and the listing stays in key order.
func testListPagingUnderWrites(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	consumer := newConsumer("churn")
	stable := map[storage.Key]bool{}
	for i := range 60 {
		k := keyOf(consumer, storage.KindMessage, fmt.Sprintf("k%03d-stable", i*2))
		acquire(t, s, claimParams(k, ""))
		stable[k] = true
	}
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var writes atomic.Int64
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				k := keyOf(consumer, storage.KindMessage, fmt.Sprintf("k%03d-churn-%d-%d", (i*7+w*13)%121, w, i))
				res, err := s.Claim(ctx, claimParams(k, ""))
				if err != nil {
					if errors.Is(err, context.Canceled) || ctx.Err() != nil {
						return
					}
					t.Errorf("claim: %v", err)
					return
				}
				switch i % 3 {
				case 0:
					_, err = s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")})
				case 1:
					_, err = s.Park(ctx, storage.ParkParams{Key: k, Token: res.Record.Token, Reason: "p"})
				}
				if err != nil && ctx.Err() == nil {
					t.Errorf("write: %v", err)
					return
				}
				writes.Add(1)
			}
		})
	}
	defer func() { cancel(); wg.Wait() }()
	for round := range 5 {
		for writes.Load() < int64(20*(round+1)) && ctx.Err() == nil {
			time.Sleep(time.Millisecond) // let the writers get going between rounds
		}
		got := listAll(t, a, storage.ListParams{Consumer: consumer, Limit: 7}, 1000)
		requireKeyOrder(t, got)
		seen := 0
		for _, r := range got {
			if stable[r.Key] {
				seen++
			}
		}
		require.Equal(t, len(stable), seen, "round %d: every stable record listed once", round)
	}
}

// testListBoundedWindow: a page reads a bounded window of the consumer's
// records, so a filter that matches none of them gives empty pages that
// still say where to go on; parked records come from their own index, so a
// listing of parked records is not held up by the records around them.
func testListBoundedWindow(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	consumer := newConsumer("window")
	n := storage.ListScanLimit(10) + 50
	ps := make([]storage.ClaimParams, 0, 100)
	for i := range n {
		ps = append(ps, claimParams(keyOf(consumer, storage.KindMessage, fmt.Sprintf("a-%05d", i)), ""))
		if len(ps) == cap(ps) || i == n-1 {
			for _, ans := range storage.ClaimBatch(t.Context(), s, ps) {
				require.NoError(t, ans.Err)
				require.Equal(t, storage.OutcomeAcquired, ans.Result.Outcome)
			}
			ps = ps[:0]
		}
	}
	var parked []storage.Key
	for _, key := range []string{"z-1", "z-2"} {
		parked = append(parked, parkedRecord(t, s, keyOf(consumer, storage.KindMessage, key), "p").Key)
	}

	page, err := a.List(t.Context(), storage.ListParams{Consumer: consumer, State: storage.StateCompleted, Limit: 10})
	require.NoError(t, err)
	require.Empty(t, page.Records)
	require.NotNil(t, page.Next, "the window ran out before the range did: the listing goes on")
	require.Negative(t, compareKeys(*page.Next, parked[0]), "the page stopped within its window")
	require.Empty(t, listAll(t, a, storage.ListParams{Consumer: consumer, State: storage.StateCompleted, Limit: 10}, 10))

	page, err = a.List(t.Context(), storage.ListParams{Consumer: consumer, State: storage.StateParked, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, parked, keysOf(page.Records), "the parked records, from the parked index, on the first page")
	require.Nil(t, page.Next)
}

// testCountParked counts live parked records per consumer under a prefix.
func testCountParked(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	base := newConsumer("count")
	one, two := base+".one", base+".two"
	parkedRecord(t, s, keyOf(one, storage.KindMessage, "1"), "p")
	parkedRecord(t, s, keyOf(two, storage.KindMessage, "1"), "p")
	toResolve := parkedRecord(t, s, keyOf(two, storage.KindOperation, "2"), "p")
	acquire(t, s, claimParams(keyOf(two, storage.KindMessage, "in-progress"), ""))
	parkedRecord(t, s, keyOf(base+"-other", storage.KindMessage, "1"), "p")

	counts, err := a.CountParked(t.Context(), base+".")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{one: 1, two: 2}, counts)

	_, err = a.Resolve(t.Context(), storage.ResolveParams{Key: toResolve.Key, Token: toResolve.Token, Reason: "r"})
	require.NoError(t, err)
	counts, err = a.CountParked(t.Context(), base+".")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{one: 1, two: 1}, counts, "a resolved record is no longer parked")

	all, err := a.CountParked(t.Context(), "")
	require.NoError(t, err)
	require.EqualValues(t, 1, all[one], "the empty prefix counts every consumer")
	require.EqualValues(t, 1, all[base+"-other"])

	c.Advance(retention + time.Second)
	counts, err = a.CountParked(t.Context(), base+".")
	require.NoError(t, err)
	require.Empty(t, counts, "expired parked records count as absent")
}
