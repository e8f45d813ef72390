package storagetest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Complete: the holder's result, repeated, late and stale
// (storage.DecideComplete).

func testComplete(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(2 * time.Second)
	done := complete(t, s, k, first.Token, "result-1")

	require.Equal(t, storage.StateCompleted, done.State)
	require.Equal(t, first.Token, done.Token)
	require.EqualValues(t, 1, done.Attempt)
	require.Equal(t, "result-1", string(done.Result))
	require.False(t, done.CompletedAt.IsZero())
	require.True(t, !done.CompletedAt.Before(first.CreatedAt.Add(2*time.Second)))
	require.Equal(t, retention, done.ExpiresAt.Sub(done.CompletedAt))
	require.True(t, done.CreatedAt.Equal(first.CreatedAt))

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

func testCompleteRepeated(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "result-1")
	c.Advance(time.Second)

	again, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("result-2")})
	require.NoError(t, err, "a repeated Complete with the same token succeeds")
	requireSame(t, done, again)
	require.Equal(t, "result-1", string(again.Result), "the first result stays")

	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token + 1, Result: []byte("result-3")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
}

func testCompleteAfterLeaseExpired(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Minute)
	done := complete(t, s, k, first.Token, "late")
	require.Equal(t, storage.StateCompleted, done.State)

	res, err := s.Claim(t.Context(), claimParams(k, "fp-1"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)
	require.Equal(t, "late", string(res.Record.Result))
}

func testCompleteStale(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Second)
	second := acquire(t, s, claimParams(k, "fp-1"))

	_, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("zombie")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, second, got)

	done := complete(t, s, k, second.Token, "winner")
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("zombie")})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "a stale token stays rejected after completion")
	got, err = s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

func testCompleteNotFound(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindOperation)
	_, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: 1, Result: []byte("x")})
	require.ErrorIs(t, err, storage.ErrNotFound)
	_, err = s.Lookup(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound, "a failed Complete creates nothing")
}
