package storagetest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Factory returns a new, empty store whose clock is moved by clock. The
// factory registers the store's cleanup with t.
type Factory func(t *testing.T, clock *Clock) storage.Store

const (
	lease     = 10 * time.Second
	retention = time.Hour
)

// Run runs the conformance suite against the stores newStore makes.
func Run(t *testing.T, newStore Factory) {
	t.Helper()
	cases := []struct {
		name string
		fn   func(t *testing.T, s storage.Store, c *Clock)
	}{
		{"ClaimNewKey", testClaimNewKey},
		{"ClaimInProgress", testClaimInProgress},
		{"ClaimInProgressFingerprintMismatch", testClaimInProgressMismatch},
		{"ClaimTakeover", testClaimTakeover},
		{"ClaimTakeoverFingerprintMismatch", testClaimTakeoverMismatch},
		{"ClaimTakeoverKeepsFingerprint", testClaimTakeoverKeepsFingerprint},
		{"ClaimCompletedReplay", testClaimCompletedReplay},
		{"ClaimCompletedFingerprintMismatch", testClaimCompletedMismatch},
		{"ClaimExpiredCompleted", testClaimExpiredCompleted},
		{"ClaimExpiredInProgress", testClaimExpiredInProgress},
		{"ClaimRepeatedRequestID", testClaimRepeatedRequestID},
		{"ClaimRequestIDAfterLease", testClaimRequestIDAfterLease},
		{"ExpiryBoundary", testExpiryBoundary},
		{"ScopesAreIndependent", testScopes},
		{"Complete", testComplete},
		{"CompleteRepeated", testCompleteRepeated},
		{"CompleteAfterLeaseExpiredWithoutTakeover", testCompleteAfterLeaseExpired},
		{"CompleteStaleToken", testCompleteStale},
		{"CompleteNotFound", testCompleteNotFound},
		{"Release", testRelease},
		{"ReleaseErrors", testReleaseErrors},
		{"Extend", testExtend},
		{"ExtendKeepsTheLease", testExtendKeepsTheLease},
		{"ExtendErrors", testExtendErrors},
		{"ExtendLeaseTotal", testExtendLeaseTotal},
		{"LookupNotFound", testLookupNotFound},
		{"TokensIncrease", testTokensIncrease},
		{"LargeResult", testLargeResult},
		{"RaceClaimNewKey", testRaceClaimNewKey},
		{"RaceTakeover", testRaceTakeover},
		{"RaceCompleteVersusTakeover", testRaceCompleteVersusTakeover},
		{"RaceFencedOperations", testRaceFenced},
		{"RaceManyKeys", testRaceManyKeys},
		{"RaceRepeatedRequestID", testRaceRepeatedRequestID},
	}
	cases = append(cases, parkCases...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := &Clock{}
			s := newStore(t, c)
			tc.fn(t, s, c)
		})
	}
}

var keySeq atomic.Int64

// newKey returns a key no other case uses, so stores may be shared.
func newKey(kind storage.Kind) storage.Key {
	n := keySeq.Add(1)
	return storage.Key{Consumer: "suite.consumer", Kind: kind, Key: fmt.Sprintf("key-%d-%d", time.Now().UnixNano(), n)}
}

func claimParams(k storage.Key, fp string) storage.ClaimParams {
	return storage.ClaimParams{Key: k, Fingerprint: []byte(fp), Lease: lease, Retention: retention, Holder: "holder-a"}
}

func acquire(t *testing.T, s storage.Store, p storage.ClaimParams) storage.Record {
	t.Helper()
	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record
}

func complete(t *testing.T, s storage.Store, k storage.Key, token int64, result string) storage.Record {
	t.Helper()
	rec, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: token, Result: []byte(result)})
	require.NoError(t, err)
	return rec
}

// requireSame checks that two reads of a record agree on every field.
func requireSame(t *testing.T, want, got storage.Record) {
	t.Helper()
	require.Equal(t, want.Key, got.Key)
	require.Equal(t, want.State, got.State)
	require.Equal(t, string(want.Fingerprint), string(got.Fingerprint))
	require.Equal(t, want.Token, got.Token)
	require.Equal(t, want.Attempt, got.Attempt)
	require.Equal(t, want.Holder, got.Holder)
	require.Equal(t, want.RequestID, got.RequestID)
	require.Equal(t, want.Lease, got.Lease)
	require.True(t, want.CreatedAt.Equal(got.CreatedAt), "created_at %v != %v", want.CreatedAt, got.CreatedAt)
	require.True(t, want.LeaseExpiresAt.Equal(got.LeaseExpiresAt), "lease_expires_at %v != %v", want.LeaseExpiresAt, got.LeaseExpiresAt)
	require.True(t, want.CompletedAt.Equal(got.CompletedAt), "completed_at %v != %v", want.CompletedAt, got.CompletedAt)
	require.True(t, want.ExpiresAt.Equal(got.ExpiresAt), "expires_at %v != %v", want.ExpiresAt, got.ExpiresAt)
	require.Equal(t, want.Retention, got.Retention)
	require.Equal(t, string(want.Result), string(got.Result))
	require.Equal(t, want.ParkReason, got.ParkReason)
}

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
	// (storagetest.RunSweeper places the horizon to the millisecond.)
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

func testRelease(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindMessage)
	first := acquire(t, s, claimParams(k, "fp-1"))
	rel, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: first.Token})
	require.NoError(t, err)
	require.Equal(t, first.Token, rel.Token)
	require.Equal(t, storage.StateInProgress, rel.State)
	require.True(t, rel.LeaseExpiresAt.Before(first.LeaseExpiresAt), "the lease ended")

	again, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: first.Token})
	require.NoError(t, err, "a repeated Release succeeds")
	require.Equal(t, first.Token, again.Token)

	p := claimParams(k, "fp-1")
	p.Holder = "holder-b"
	second := acquire(t, s, p) // at once: no waiting for the lease
	require.Greater(t, second.Token, first.Token)
	require.EqualValues(t, 2, second.Attempt)

	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: first.Token})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, second, got)
}

func testReleaseErrors(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindMessage)
	_, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: 1})
	require.ErrorIs(t, err, storage.ErrNotFound)

	first := acquire(t, s, claimParams(k, "fp-1"))
	done := complete(t, s, k, first.Token, "result-1")
	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: first.Token})
	require.ErrorIs(t, err, storage.ErrAlreadyCompleted)
	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: first.Token - 1})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

func testExtend(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease - time.Second)
	ext, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, first.Token, ext.Token)
	require.EqualValues(t, 1, ext.Attempt)
	require.True(t, ext.LeaseExpiresAt.After(first.LeaseExpiresAt))
	require.Equal(t, ext.LeaseExpiresAt.Add(retention), ext.ExpiresAt)

	c.Advance(30 * time.Second) // past the first lease, inside the extended one
	res, err := s.Claim(t.Context(), claimParams(k, "fp-1"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeInProgress, res.Outcome)
	requireSame(t, ext, res.Record)

	c.Advance(time.Minute) // a lease that ran out can be extended while nobody took over
	ext2, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, Lease: time.Minute})
	require.NoError(t, err)
	require.True(t, ext2.LeaseExpiresAt.After(ext.LeaseExpiresAt))
}

// testExtendKeepsTheLease: an Extend without a lease extends by the lease
// the key was claimed with, or by the last one an Extend asked for.
func testExtendKeepsTheLease(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	p := claimParams(k, "fp-1")
	p.Lease = 20 * time.Second
	first := acquire(t, s, p)
	require.Equal(t, 20*time.Second, first.Lease)
	const fallback = 7 * time.Second // for records without a lease; not used here

	c.Advance(5 * time.Second)
	ext, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, DefaultLease: fallback})
	require.NoError(t, err)
	require.Equal(t, 20*time.Second, ext.Lease)
	// now + the claimed lease; loose, since a store's clock runs on: the
	// fallback would give -8 s, the lease asked for next +25 s.
	requireBetween(t, ext.LeaseExpiresAt.Sub(first.LeaseExpiresAt), 5*time.Second, 15*time.Second, "now + the claimed lease")

	ext, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, Lease: 40 * time.Second, DefaultLease: fallback})
	require.NoError(t, err)
	require.Equal(t, 40*time.Second, ext.Lease)
	c.Advance(time.Second)
	again, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, DefaultLease: fallback})
	require.NoError(t, err)
	require.Equal(t, 40*time.Second, again.Lease)
	requireBetween(t, again.LeaseExpiresAt.Sub(ext.LeaseExpiresAt), time.Second, 11*time.Second, "now + the last lease asked for")

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, again, got)
}

func requireBetween(t *testing.T, d, lo, hi time.Duration, msg string) {
	t.Helper()
	require.GreaterOrEqual(t, d, lo, msg)
	require.Less(t, d, hi, msg)
}

// testExtendLeaseTotal: with MaxLeaseTotal, an Extend that would hold the
// key past the start of the attempt plus the total is refused and changes
// nothing; a takeover is a new attempt, with a total of its own.
func testExtendLeaseTotal(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	const total = time.Minute
	extend := func(token int64, lease time.Duration) (storage.Record, error) {
		return s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: token, Lease: lease, MaxLeaseTotal: total})
	}
	first := acquire(t, s, claimParams(k, "fp-1")) // at 0, the lease to 10 s
	require.Equal(t, first.Token, first.CreatedAt.UnixMicro(), "the token of a new key is its acquisition's microsecond")
	c.Advance(5 * time.Second)
	ext, err := extend(first.Token, 30*time.Second) // to 35 s
	require.NoError(t, err)

	c.Advance(20 * time.Second)
	_, err = extend(first.Token, 40*time.Second) // to 65 s: past 60 s
	require.ErrorIs(t, err, storage.ErrLeaseTotalExceeded)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, ext, got)
	_, err = extend(first.Token, 30*time.Second) // to 55 s
	require.NoError(t, err, "what is left of the total can still be taken")

	c.Advance(time.Minute) // at 85 s: the lease ran out at 55 s
	second := acquire(t, s, claimParams(k, "fp-1"))
	require.EqualValues(t, 2, second.Attempt)
	_, err = extend(second.Token, 50*time.Second) // to 135 s: within 85 s + 60 s
	require.NoError(t, err, "a takeover starts a total of its own")
	_, err = extend(second.Token, 0) // by the 50 s lease again, from 85 s: within
	require.NoError(t, err)
	c.Advance(20 * time.Second)
	_, err = extend(second.Token, 0) // from 105 s to 155 s: past 145 s
	require.ErrorIs(t, err, storage.ErrLeaseTotalExceeded, "an Extend by the record's own lease is bounded too")
	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: second.Token, Lease: 50 * time.Second})
	require.NoError(t, err, "without a total, no bound")
}

func testExtendErrors(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	_, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: 1, Lease: lease})
	require.ErrorIs(t, err, storage.ErrNotFound)

	first := acquire(t, s, claimParams(k, "fp-1"))
	c.Advance(lease + time.Second)
	second := acquire(t, s, claimParams(k, "fp-1"))
	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: first.Token, Lease: lease})
	require.ErrorIs(t, err, storage.ErrLeaseLost)

	done := complete(t, s, k, second.Token, "result")
	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: second.Token, Lease: lease})
	require.ErrorIs(t, err, storage.ErrAlreadyCompleted)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, done, got)
}

func testLookupNotFound(t *testing.T, s storage.Store, _ *Clock) {
	_, err := s.Lookup(t.Context(), newKey(storage.KindMessage))
	require.ErrorIs(t, err, storage.ErrNotFound)
}

// testTokensIncrease walks one key through release, takeover, completion and
// expiry, and checks every token is greater than every token before it.
func testTokensIncrease(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	var last int64
	next := func(rec storage.Record) {
		t.Helper()
		require.Greater(t, rec.Token, last)
		last = rec.Token
	}
	rec := acquire(t, s, claimParams(k, "fp"))
	next(rec)
	_, err := s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: rec.Token})
	require.NoError(t, err)
	rec = acquire(t, s, claimParams(k, "fp"))
	next(rec)
	c.Advance(lease + time.Millisecond)
	rec = acquire(t, s, claimParams(k, "fp"))
	next(rec)
	complete(t, s, k, rec.Token, "r")
	c.Advance(retention + time.Millisecond)
	rec = acquire(t, s, claimParams(k, "fp"))
	next(rec)
	c.Advance(lease + retention + time.Millisecond)
	rec = acquire(t, s, claimParams(k, "fp"))
	next(rec)
}

func testLargeResult(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, ""))
	big := make([]byte, 1<<20)
	for i := range big {
		big[i] = byte(i * 7)
	}
	done, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: rec.Token, Result: big})
	require.NoError(t, err)
	require.Equal(t, big, done.Result)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	require.Equal(t, big, got.Result)
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

func parallel[T any](n int, fn func(i int) T) []T {
	out := make([]T, n)
	var start, done sync.WaitGroup
	start.Add(1)
	for i := range n {
		done.Go(func() {
			start.Wait()
			out[i] = fn(i)
		})
	}
	start.Done()
	done.Wait()
	return out
}

type claimAnswer struct {
	res storage.ClaimResult
	err error
}

// raceClaims runs n Claims at once, the i-th with params(i).
func raceClaims(s storage.Store, n int, params func(i int) storage.ClaimParams) []claimAnswer {
	return parallel(n, func(i int) claimAnswer {
		res, err := s.Claim(context.Background(), params(i))
		return claimAnswer{res, err}
	})
}

func testRaceClaimNewKey(t *testing.T, s storage.Store, _ *Clock) {
	for range 5 {
		k := newKey(storage.KindMessage)
		answers := raceClaims(s, 64, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.Holder = fmt.Sprintf("holder-%d", i)
			return p
		})
		var winner *storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				require.Nil(t, winner, "two callers acquired one key")
				winner = &a.res.Record
			}
		}
		require.NotNil(t, winner, "nobody acquired")
		for _, a := range answers {
			if a.res.Outcome != storage.OutcomeAcquired {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.Equal(t, winner.Token, a.res.Record.Token)
				require.Equal(t, winner.Holder, a.res.Record.Holder)
			}
		}
	}
}

// testRaceRepeatedRequestID races repeats of one Claim (the same request
// id, as a client retrying after a lost reply would send) against Claims
// with ids of their own: one claim wins, and whoever sees ACQUIRED holds the
// winner's token with the winner's id; nobody else does.
func testRaceRepeatedRequestID(t *testing.T, s storage.Store, _ *Clock) {
	idOf := func(i int) string {
		if i%2 == 0 {
			return "repeated"
		}
		return fmt.Sprintf("own-%d", i)
	}
	for round := range 6 {
		k := newKey(storage.KindMessage)
		answers := raceClaims(s, 32, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.RequestID = idOf(i)
			return p
		})
		var winner *storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				if winner == nil {
					winner = &a.res.Record
				}
				require.Equal(t, winner.Token, a.res.Record.Token, "two tokens acquired for one key")
			}
		}
		require.NotNil(t, winner, "nobody acquired (round %d)", round)
		for i, a := range answers {
			id := idOf(i)
			require.Equal(t, winner.Token, a.res.Record.Token)
			if a.res.Outcome == storage.OutcomeAcquired {
				require.Equal(t, winner.RequestID, id, "caller %d got a token its request id did not win", i)
			} else {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.NotEqual(t, winner.RequestID, id, "caller %d repeated the winning claim and was refused", i)
			}
		}
	}
}

func testRaceTakeover(t *testing.T, s storage.Store, c *Clock) {
	for range 5 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		answers := raceClaims(s, 32, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.Holder = fmt.Sprintf("holder-%d", i)
			return p
		})
		acquired := 0
		var winner storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				acquired++
				winner = a.res.Record
			}
		}
		require.Equal(t, 1, acquired, "exactly one takeover wins")
		require.Greater(t, winner.Token, first.Token)
		require.EqualValues(t, 2, winner.Attempt)
		for _, a := range answers {
			if a.res.Outcome != storage.OutcomeAcquired {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.Equal(t, winner.Token, a.res.Record.Token)
			}
		}
	}
}

// testRaceCompleteVersusTakeover races a late Complete by the holder of an
// expired lease against takeovers: either the Complete is accepted and the
// takeovers replay it, or one takeover wins and the Complete is LEASE_LOST.
func testRaceCompleteVersusTakeover(t *testing.T, s storage.Store, c *Clock) {
	completedFirst, takenFirst := 0, 0
	for range 20 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)

		var completeErr error
		answers := parallel(9, func(i int) claimAnswer {
			if i == 0 {
				_, completeErr = s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("zombie")})
				return claimAnswer{}
			}
			res, err := s.Claim(context.Background(), claimParams(k, "fp"))
			return claimAnswer{res, err}
		})[1:]

		acquired := 0
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				acquired++
			}
		}
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		if completeErr == nil {
			completedFirst++
			require.Zero(t, acquired, "a takeover won after the Complete was accepted")
			require.Equal(t, storage.StateCompleted, got.State)
			require.Equal(t, first.Token, got.Token)
			require.Equal(t, "zombie", string(got.Result))
			for _, a := range answers {
				require.Equal(t, storage.OutcomeCompleted, a.res.Outcome)
			}
		} else {
			takenFirst++
			require.ErrorIs(t, completeErr, storage.ErrLeaseLost)
			require.Equal(t, 1, acquired, "exactly one takeover wins")
			require.Equal(t, storage.StateInProgress, got.State)
			require.Greater(t, got.Token, first.Token)
		}
	}
	t.Logf("complete won %d times, takeover won %d times", completedFirst, takenFirst)
}

// testRaceFenced races Complete, Release and Extend by a stale and a current
// holder: the stale one always loses and the current one always wins.
func testRaceFenced(t *testing.T, s storage.Store, c *Clock) {
	for range 10 {
		k := newKey(storage.KindOperation)
		stale := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		current := acquire(t, s, claimParams(k, "fp"))

		errs := parallel(8, func(i int) error {
			token := stale.Token
			if i%2 == 1 {
				token = current.Token
			}
			var err error
			switch i / 2 {
			case 0, 1:
				_, err = s.Extend(context.Background(), storage.ExtendParams{Key: k, Token: token, Lease: lease})
			case 2:
				_, err = s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: token, Result: fmt.Appendf(nil, "from-%d", token)})
			case 3:
				_, err = s.Release(context.Background(), storage.ReleaseParams{Key: k, Token: token})
			}
			return err
		})
		for i, err := range errs {
			if i%2 == 0 {
				require.ErrorIs(t, err, storage.ErrLeaseLost, "stale operation %d", i)
			} else if err != nil {
				// The current holder's Complete, Release and Extends race
				// each other: a Release or Extend after the Complete finds
				// the record completed.
				require.ErrorIs(t, err, storage.ErrAlreadyCompleted, "current operation %d", i)
			}
		}
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, current.Token, got.Token)
		require.Equal(t, storage.StateCompleted, got.State)
		require.Equal(t, fmt.Sprintf("from-%d", current.Token), string(got.Result))
	}
}

// testRaceManyKeys runs claim/complete/release cycles from many goroutines
// over a few keys and checks that no token of a key is issued twice and that
// a key is completed only by the holder of its last token.
func testRaceManyKeys(t *testing.T, s storage.Store, _ *Clock) {
	keys := []storage.Key{newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindMessage)}
	var mu sync.Mutex
	type keyToken struct {
		key   storage.Key
		token int64
	}
	issued := map[keyToken]bool{}
	completedBy := map[storage.Key]int64{}
	errs := parallel(16, func(i int) error {
		for n := range 15 {
			k := keys[(i+n)%len(keys)]
			p := claimParams(k, "")
			p.Lease = time.Minute
			res, err := s.Claim(context.Background(), p)
			if err != nil {
				return err
			}
			if res.Outcome != storage.OutcomeAcquired {
				continue
			}
			mu.Lock()
			kt := keyToken{k, res.Record.Token}
			dup := issued[kt]
			issued[kt] = true
			mu.Unlock()
			if dup {
				return fmt.Errorf("token %d issued twice", res.Record.Token)
			}
			if n%3 == 0 {
				if _, err := s.Release(context.Background(), storage.ReleaseParams{Key: k, Token: res.Record.Token}); err != nil {
					return err
				}
				continue
			}
			if _, err := s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")}); err != nil {
				return err
			}
			mu.Lock()
			prev, seen := completedBy[k]
			completedBy[k] = res.Record.Token
			mu.Unlock()
			if seen && prev != res.Record.Token {
				return fmt.Errorf("key %s completed by tokens %d and %d", k.Key, prev, res.Record.Token)
			}
		}
		return nil
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.NotEmpty(t, issued)
	for k, token := range completedBy {
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, token, got.Token)
		require.Equal(t, storage.StateCompleted, got.State)
	}
}
