package storagetest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// What every record keeps: Lookup, fencing tokens, large results.

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
