package storagetest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// The lease: Release and Extend by its holder (storage.DecideRelease,
// storage.DecideExtend).

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
