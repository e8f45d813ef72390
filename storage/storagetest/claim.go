package storagetest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Claim: a new key, a live or expired holder, a completed record, the
// fingerprint and the request id (storage.DecideClaim).

func testClaimNewKey(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindMessage)
	before := c.Now().Add(-time.Minute) // loose: a SQL store's clock is the database's
	rec := acquire(t, s, claimParams(k, "fp-1"))

	require.Equal(t, k, rec.Key)
	require.Equal(t, storage.StateInProgress, rec.State)
	require.Equal(t, "fp-1", string(rec.Fingerprint))
	require.Positive(t, rec.Token)
	require.EqualValues(t, 1, rec.Attempt)
	require.Equal(t, "holder-a", rec.Holder)
	require.True(t, rec.CreatedAt.After(before))
	require.Equal(t, lease, rec.LeaseExpiresAt.Sub(rec.CreatedAt))
	require.True(t, rec.CompletedAt.IsZero())
	require.Equal(t, lease+retention, rec.ExpiresAt.Sub(rec.CreatedAt))
	require.Equal(t, retention, rec.Retention)
	require.Empty(t, rec.Result)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, rec, got)
}

func testClaimInProgress(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(4 * time.Second)

	for _, fp := range []string{"fp-1", ""} {
		p := claimParams(k, fp)
		p.Holder = "holder-b"
		res, err := s.Claim(t.Context(), p)
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeInProgress, res.Outcome)
		requireSame(t, first, res.Record)
		require.Greater(t, res.RetryAfter, time.Duration(0))
		require.LessOrEqual(t, res.RetryAfter, lease-4*time.Second)
		require.Greater(t, res.RetryAfter, lease-4*time.Second-time.Minute)
	}
}

func testClaimInProgressMismatch(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	_, err := s.Claim(t.Context(), claimParams(k, "fp-2"))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, first, got)
}

func testClaimTakeover(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Second)

	p := claimParams(k, "fp-1")
	p.Holder = "holder-b"
	p.Lease = 20 * time.Second
	second := acquire(t, s, p)
	require.Greater(t, second.Token, first.Token)
	require.EqualValues(t, 2, second.Attempt)
	require.Equal(t, "holder-b", second.Holder)
	require.True(t, second.CreatedAt.Equal(first.CreatedAt), "a takeover keeps created_at")
	require.Equal(t, storage.StateInProgress, second.State)
	require.True(t, second.LeaseExpiresAt.After(first.LeaseExpiresAt))
	require.Equal(t, second.LeaseExpiresAt.Add(retention), second.ExpiresAt)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, second, got)
}

func testClaimTakeoverMismatch(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Second)
	_, err := s.Claim(t.Context(), claimParams(k, "fp-2"))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, first, got)
}

func testClaimTakeoverKeepsFingerprint(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Second)
	second := acquire(t, s, claimParams(k, ""))
	require.Equal(t, "fp-1", string(second.Fingerprint), "a takeover without a fingerprint keeps the stored one")

	k2 := newKey(storage.KindOperation)
	acquire(t, s, claimParams(k2, ""))
	c.Advance(lease + time.Second)
	second = acquire(t, s, claimParams(k2, "fp-2"))
	require.Equal(t, "fp-2", string(second.Fingerprint), "a takeover records a fingerprint where none was stored")
}

func testClaimCompletedReplay(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "result-1")
	c.Advance(lease + time.Second) // a completed record replays whatever its lease says

	for _, fp := range []string{"fp-1", ""} {
		res, err := s.Claim(t.Context(), claimParams(k, fp))
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeCompleted, res.Outcome)
		requireSame(t, done, res.Record)
		require.Equal(t, "result-1", string(res.Record.Result))
	}
}

func testClaimCompletedMismatch(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "result-1")
	_, err := s.Claim(t.Context(), claimParams(k, "fp-2"))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

func testClaimExpiredCompleted(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, "fp-1"))
	complete(t, s, k, first.Token, "result-1")
	c.Advance(retention + time.Second)

	_, err := s.Lookup(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound, "an expired record counts as absent before it is swept")

	p := claimParams(k, "fp-2") // a different fingerprint is no conflict once expired
	p.Holder = "holder-b"
	second := acquire(t, s, p)
	require.Greater(t, second.Token, first.Token)
	require.EqualValues(t, 1, second.Attempt)
	require.Equal(t, "fp-2", string(second.Fingerprint))
	require.Equal(t, "holder-b", second.Holder)
	require.True(t, second.CreatedAt.After(first.CreatedAt))
	require.True(t, second.CompletedAt.IsZero())
	require.Empty(t, second.Result)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, second, got)
}

func testClaimExpiredInProgress(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, ""))
	c.Advance(lease + retention + time.Second)
	second := acquire(t, s, claimParams(k, "fp-2"))
	require.Greater(t, second.Token, first.Token)
	require.EqualValues(t, 1, second.Attempt)
	require.Equal(t, "fp-2", string(second.Fingerprint))
}

// testExpiryBoundary checks both sides of expires_at: a record is live until
// the instant it expires, and absent from that instant on.
func testExpiryBoundary(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "result-1")
	// The store's clock is ahead of the completion by the time it took to
	// answer, so step to a second before expiry: the slack covers that time.
	// (the Sweeper area places the horizon to the millisecond.)
	c.Advance(retention - time.Second)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err, "a record a second before expiry is live")
	requireSame(t, done, got)
	res, err := s.Claim(t.Context(), claimParams(k, "fp-1"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)

	c.Advance(time.Second)
	_, err = s.Lookup(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound, "a record is absent once expires_at is reached")
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("x")})
	require.ErrorIs(t, err, storage.ErrNotFound)
}

func testScopes(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindMessage)
	a := acquire(t, s, claimParams(k, "fp-1"))
	other := []storage.Key{
		{Consumer: k.Consumer, Kind: storage.KindOperation, Key: k.Key},
		{Consumer: k.Consumer + ".other", Kind: k.Kind, Key: k.Key},
	}
	for _, o := range other {
		rec := acquire(t, s, claimParams(o, "fp-2"))
		require.Equal(t, o, rec.Key)
		_, err := s.Complete(t.Context(), storage.CompleteParams{Key: o, Token: a.Token, Result: []byte("x")})
		require.ErrorIs(t, err, storage.ErrLeaseLost, "a token of one scope does not fence another")
	}
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, a, got)
}

// parallel runs fn n times at once, released together, and returns the
// results in order.
// testClaimRepeatedRequestID: a repeat of the Claim that holds a live lease
// (same request id) gets the same answer, token included, and writes
// nothing; any other Claim, with another id or none, is IN_PROGRESS.
func testClaimRepeatedRequestID(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	p := claimParams(k, "fp-1")
	p.RequestID = "req-1"
	first := acquire(t, s, p)
	require.Equal(t, "req-1", first.RequestID)
	c.Advance(2 * time.Second)

	repeat := p
	repeat.Holder = "holder-a-retry"
	repeat.Lease = 2 * lease
	res, err := s.Claim(t.Context(), repeat)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	require.True(t, res.Repeated)
	requireSame(t, first, res.Record) // same token, attempt, holder and lease: nothing written

	for _, id := range []string{"req-2", ""} {
		other := claimParams(k, "fp-1")
		other.RequestID = id
		res, err := s.Claim(t.Context(), other)
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeInProgress, res.Outcome, "request id %q", id)
		requireSame(t, first, res.Record)
	}

	mismatch := p
	mismatch.Fingerprint = []byte("fp-2")
	_, err = s.Claim(t.Context(), mismatch)
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch, "the request id does not bypass the fingerprint")

	done := complete(t, s, k, first.Token, "result-1")
	res, err = s.Claim(t.Context(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome, "after Complete a repeat replays")
	requireSame(t, done, res.Record)

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

// testClaimRequestIDAfterLease: once the lease ran out, a repeat with the
// same request id is a takeover like any other Claim: a new token, and the
// old one is fenced out.
func testClaimRequestIDAfterLease(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	p := claimParams(k, "fp-1")
	p.RequestID = "req-1"
	first := acquire(t, s, p)
	c.Advance(lease + time.Second)

	second := acquire(t, s, p)
	require.Greater(t, second.Token, first.Token)
	require.EqualValues(t, 2, second.Attempt)
	require.Equal(t, "req-1", second.RequestID)
	_, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("stale")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)

	// A takeover with another id, or none, replaces the stored id.
	c.Advance(lease + time.Second)
	p.RequestID = ""
	third := acquire(t, s, p)
	require.Empty(t, third.RequestID)
	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeInProgress, res.Outcome, "an empty request id never matches")
}
