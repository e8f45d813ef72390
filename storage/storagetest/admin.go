package storagetest

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// adminCases are the cases of the storage.Admin capability: Inspect and
// Invalidate here, the reconciliation (history, Resolve, List,
// CountParked) in reconcile.go.
func adminCases() []testCase[storage.Admin] {
	return slices.Concat([]testCase[storage.Admin]{
		{"InspectMissing", testInspectMissing},
		{"InspectShowsEverything", testInspectShowsEverything},
		{"InspectExpired", testInspectExpired},
		{"InvalidateCompleted", testInvalidateCompleted},
		{"InvalidateInProgressFencesHolder", testInvalidateInProgress},
		{"InvalidateExpectedToken", testInvalidateExpectedToken},
		{"InvalidateNotFound", testInvalidateNotFound},
		{"InvalidateResolvesParked", testInvalidateResolvesParked},
		{"InvalidateTokensIncrease", testInvalidateTokensIncrease},
		{"InvalidatedRecordOutlivesSweep", testInvalidatedOutlivesSweep},
		{"RaceInvalidateVersusComplete", testRaceInvalidateVersusComplete},
	}, reconcileCases)
}

func testInspectMissing(t *testing.T, _ storage.Store, a storage.Admin, _ *Clock) {
	_, err := a.Inspect(t.Context(), newKey(storage.KindMessage))
	require.ErrorIs(t, err, storage.ErrNotFound)
}

func testInspectShowsEverything(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, "fp-1"))
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, rec, got.Record)
	require.Equal(t, rec.Token, got.Record.Token, "an operator sees the token Lookup withholds")
	require.True(t, got.Now.Before(got.Record.ExpiresAt))

	done := complete(t, s, k, rec.Token, "result-1")
	got, err = a.Inspect(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got.Record)
	require.Equal(t, "result-1", string(got.Record.Result))
}

func testInspectExpired(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindMessage)
	rec := acquire(t, s, claimParams(k, ""))
	c.Advance(lease + retention + time.Second)
	_, err := s.Lookup(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound)
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err, "an expired record stays visible to an operator until it is swept")
	requireSame(t, rec, got.Record)
	require.False(t, got.Now.Before(got.Record.ExpiresAt))
}

func testInvalidateCompleted(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "wrong result")

	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, inv.State)
	require.Empty(t, inv.Result)
	require.Empty(t, inv.Fingerprint)
	require.True(t, inv.CompletedAt.IsZero())
	require.Greater(t, inv.Token, done.Token)
	require.Equal(t, done.Attempt, inv.Attempt)
	require.True(t, done.CreatedAt.Equal(inv.CreatedAt))
	require.False(t, inv.ExpiresAt.Before(inv.LeaseExpiresAt.Add(inv.Retention)),
		"kept at least its retention after the token it was given")
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, inv, got.Record)
	require.False(t, got.Now.Before(got.Record.LeaseExpiresAt), "the lease ended")

	// The stale holder's calls lose; the next Claim takes over at once, with
	// another fingerprint, a larger token and attempt + 1.
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	res, err := s.Claim(t.Context(), claimParams(k, "fp-2"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	require.Greater(t, res.Record.Token, inv.Token)
	require.Equal(t, inv.Attempt+1, res.Record.Attempt)
	require.Equal(t, "fp-2", string(res.Record.Fingerprint))
	complete(t, s, k, res.Record.Token, "right result")
	replay, err := s.Claim(t.Context(), claimParams(k, "fp-2"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, replay.Outcome)
	require.Equal(t, "right result", string(replay.Record.Result))
}

func testInvalidateInProgress(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindMessage)
	stuck := acquire(t, s, claimParams(k, "fp-1"))
	busy, err := s.Claim(t.Context(), claimParams(k, "fp-1"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeInProgress, busy.Outcome, "the lease is live")

	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
	require.NoError(t, err)
	require.Greater(t, inv.Token, stuck.Token)

	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: stuck.Token, Lease: lease})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: stuck.Token})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: stuck.Token, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)

	res, err := s.Claim(t.Context(), claimParams(k, "fp-1"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome, "acquired at once, without waiting for the stuck lease")
	require.Greater(t, res.Record.Token, inv.Token)
	require.EqualValues(t, 2, res.Record.Attempt)
}

func testInvalidateExpectedToken(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	_, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: rec.Token + 1})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, rec, got.Record)

	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: rec.Token})
	require.NoError(t, err)
	_, err = a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: rec.Token})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "a repeated invalidation with the old token does not invalidate again")
	again, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: inv.Token})
	require.NoError(t, err)
	require.Greater(t, again.Token, inv.Token)
}

func testInvalidateNotFound(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindMessage)
	_, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
	require.ErrorIs(t, err, storage.ErrNotFound)
	acquire(t, s, claimParams(k, ""))
	c.Advance(lease + retention)
	_, err = a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
	require.ErrorIs(t, err, storage.ErrNotFound, "an expired record counts as absent")
}

// testInvalidateTokensIncrease alternates Claims and invalidations of one
// key as fast as the store answers, without moving the clock: every token is
// larger than all before it, though many are issued within the same
// millisecond.
func testInvalidateTokensIncrease(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	k := newKey(storage.KindOperation)
	var last int64
	for i := range 20 {
		res, err := s.Claim(t.Context(), claimParams(k, ""))
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeAcquired, res.Outcome, "round %d", i)
		require.Greater(t, res.Record.Token, last, "round %d", i)
		inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
		require.NoError(t, err)
		require.Greater(t, inv.Token, res.Record.Token, "round %d", i)
		last = inv.Token
	}
}

// testInvalidatedOutlivesSweep checks the reason invalidation keeps the
// record: a sweep right after it deletes nothing of the key, so the next
// token is above the invalidated one through the stored row, whatever the
// clock did; only after the record's retention, when the clock is far past
// its token, is it swept.
func testInvalidatedOutlivesSweep(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	sw, ok := s.(storage.Sweeper)
	if !ok {
		t.Skip("the store has no sweeper")
	}
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	complete(t, s, k, rec.Token, "r")
	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
	require.NoError(t, err)

	c.Advance(time.Second) // past the lease, which ended at the invalidation
	_, err = sweepAll(t.Context(), sw, 100)
	require.NoError(t, err)
	got, err := a.Inspect(t.Context(), k)
	require.NoError(t, err, "the invalidated record is not swept before its retention")
	require.Equal(t, inv.Token, got.Record.Token)

	c.Advance(retention)
	_, err = sweepAll(t.Context(), sw, 100)
	require.NoError(t, err)
	_, err = a.Inspect(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound, "swept after its retention")
	res, err := s.Claim(t.Context(), claimParams(k, ""))
	require.NoError(t, err)
	require.Greater(t, res.Record.Token, inv.Token)
	require.EqualValues(t, 1, res.Record.Attempt)
}

// testRaceInvalidateVersusComplete races a holder's Complete against an
// invalidation: either the Complete lands first and the invalidation clears
// it, or the invalidation lands first and the Complete loses. Never both a
// stored result and a fenced-out holder.
func testRaceInvalidateVersusComplete(t *testing.T, s storage.Store, a storage.Admin, _ *Clock) {
	for range 10 {
		k := newKey(storage.KindOperation)
		rec := acquire(t, s, claimParams(k, ""))
		errs := parallel(2, func(i int) error {
			if i == 0 {
				_, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte("r")})
				return err
			}
			_, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k})
			return err
		})
		require.NoError(t, errs[1])
		if errs[0] != nil {
			require.ErrorIs(t, errs[0], storage.ErrLeaseLost)
		}
		got, err := a.Inspect(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, storage.StateInProgress, got.Record.State, "the invalidation is the last word either way")
		require.Empty(t, got.Record.Result)
		require.Greater(t, got.Record.Token, rec.Token)
	}
}

// testInvalidateResolvesParked: invalidating a parked record is how an
// operator resolves it: the next Claim takes over as attempt 1, so the
// consumer's max_attempts counts afresh, and the parked token is fenced.
func testInvalidateResolvesParked(t *testing.T, s storage.Store, a storage.Admin, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, atMost(claimParams(k, "fp"), 1))
	c.Advance(lease + time.Second)
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	parked := requireParked(t, res, err)

	inv, err := a.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Token: parked.Token})
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, inv.State)
	require.Empty(t, inv.ParkReason)
	require.Zero(t, inv.Attempt)

	next := acquire(t, s, atMost(claimParams(k, "fp"), 1))
	require.EqualValues(t, 1, next.Attempt)
	require.Greater(t, next.Token, inv.Token)
	_, err = s.Park(t.Context(), storage.ParkParams{Key: k, Token: first.Token, Reason: "late"})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
}
