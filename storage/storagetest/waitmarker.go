package storagetest

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// waitMarkerCases are the cases of the storage.WaitMarker capability.
// Cases use keys of their own, so stores may be shared.
var waitMarkerCases = []testCase[storage.WaitMarker]{
	{"CompleteReturnsMarks", testMarksReturnedByComplete},
	{"NoMarkNoWaiters", testNoMarkNoWaiters},
	{"ReleaseAndParkReturnMarks", testMarksReturnedByReleaseAndPark},
	{"BatchCompleteReturnsMarks", testMarksReturnedByBatchComplete},
	{"MarkRefusedOnceEnded", testMarkRefusedOnceEnded},
	{"AcquisitionClearsMarks", testAcquisitionClearsMarks},
}

func mark(t *testing.T, m storage.WaitMarker, k storage.Key, token int64, replica string) bool {
	t.Helper()
	ok, err := m.MarkWaiting(t.Context(), storage.MarkWaitingParams{Key: k, Token: token, Replica: replica})
	require.NoError(t, err)
	return ok
}

// testMarksReturnedByComplete: each replica is marked once however often
// it marks; the Complete that ends the attempt returns them, a repeat of
// it and the reads do not.
func testMarksReturnedByComplete(t *testing.T, s storage.Store, m storage.WaitMarker, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	require.True(t, mark(t, m, k, rec.Token, "r1"))
	require.True(t, mark(t, m, k, rec.Token, "r2"))
	require.True(t, mark(t, m, k, rec.Token, "r1"))
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	require.Nil(t, got.Waiters, "only the call that ends an attempt returns its waiters")
	done := complete(t, s, k, rec.Token, "result")
	require.ElementsMatch(t, []string{"r1", "r2"}, done.Waiters)
	again := complete(t, s, k, rec.Token, "result")
	require.Nil(t, again.Waiters, "a repeated Complete ended nothing")
}

func testNoMarkNoWaiters(t *testing.T, s storage.Store, _ storage.WaitMarker, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	require.Nil(t, complete(t, s, k, rec.Token, "result").Waiters)
}

func testMarksReturnedByReleaseAndPark(t *testing.T, s storage.Store, m storage.WaitMarker, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	require.True(t, mark(t, m, k, rec.Token, "r1"))
	rel, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: rec.Token})
	require.NoError(t, err)
	require.Equal(t, []string{"r1"}, rel.Waiters)

	k = newKey(storage.KindOperation)
	rec = acquire(t, s, claimParams(k, ""))
	require.True(t, mark(t, m, k, rec.Token, "r2"))
	ext, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: rec.Token, Lease: lease})
	require.NoError(t, err)
	require.True(t, mark(t, m, k, ext.Token, "r3"), "an Extend ends nothing: the marks stay")
	parked, err := s.Park(t.Context(), storage.ParkParams{Key: k, Token: rec.Token, Reason: "unknown outcome"})
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"r2", "r3"}, parked.Waiters)
}

func testMarksReturnedByBatchComplete(t *testing.T, s storage.Store, m storage.WaitMarker, _ *Clock) {
	k1, k2 := newKey(storage.KindOperation), newKey(storage.KindOperation)
	r1, r2 := acquire(t, s, claimParams(k1, "")), acquire(t, s, claimParams(k2, ""))
	require.True(t, mark(t, m, k2, r2.Token, "r9"))
	answers := storage.CompleteBatch(t.Context(), s, []storage.CompleteParams{
		{Key: k1, Token: r1.Token, Result: []byte("a")}, {Key: k2, Token: r2.Token, Result: []byte("b")},
	})
	require.NoError(t, answers[0].Err)
	require.NoError(t, answers[1].Err)
	require.Nil(t, answers[0].Record.Waiters)
	require.Equal(t, []string{"r9"}, answers[1].Record.Waiters)
}

// testMarkRefusedOnceEnded: a mark of an attempt that has ended (completed,
// released, its lease run out, another token, no record) is refused, so
// that the waiter decides again rather than waits for a call that came.
func testMarkRefusedOnceEnded(t *testing.T, s storage.Store, m storage.WaitMarker, c *Clock) {
	require.False(t, mark(t, m, newKey(storage.KindOperation), 1, "r1"), "no record")

	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	require.False(t, mark(t, m, k, rec.Token+1, "r1"), "another token")
	complete(t, s, k, rec.Token, "result")
	require.False(t, mark(t, m, k, rec.Token, "r1"), "completed")

	k = newKey(storage.KindOperation)
	rec = acquire(t, s, claimParams(k, ""))
	_, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: rec.Token})
	require.NoError(t, err)
	require.False(t, mark(t, m, k, rec.Token, "r1"), "released")

	k = newKey(storage.KindOperation)
	rec = acquire(t, s, claimParams(k, ""))
	c.Advance(lease)
	require.False(t, mark(t, m, k, rec.Token, "r1"), "lease over")
}

// testAcquisitionClearsMarks: the marks of an attempt taken over are
// gone; the next attempt's end returns only its own.
func testAcquisitionClearsMarks(t *testing.T, s storage.Store, m storage.WaitMarker, c *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	require.True(t, mark(t, m, k, rec.Token, "r1"))
	c.Advance(lease)
	next := acquire(t, s, claimParams(k, ""))
	require.Greater(t, next.Token, rec.Token)
	require.True(t, mark(t, m, k, next.Token, "r2"))
	require.Equal(t, []string{"r2"}, complete(t, s, k, next.Token, "result").Waiters)
}
