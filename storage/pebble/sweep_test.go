package pebble

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// TestExpiryIndexConsistent runs random operations, sweeps included, from
// several goroutines and then checks the index holds exactly one entry per
// record, at the record's expires_at.
func TestExpiryIndexConsistent(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, t.TempDir(), WithClock(clock.Now))
	ctx := t.Context()

	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range 400 {
				k := key(fmt.Sprintf("k%d", rng.IntN(40)))
				lease := time.Duration(1+rng.IntN(60)) * time.Second
				switch rng.IntN(7) {
				case 0, 1:
					_, _ = s.Claim(ctx, claimP(k, lease, time.Duration(rng.IntN(120)+1)*time.Second))
				case 2, 3:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Complete(ctx, storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte("r")})
					}
				case 4:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Extend(ctx, storage.ExtendParams{Key: k, Token: rec.Token, Lease: lease})
					}
				case 5:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Release(ctx, storage.ReleaseParams{Key: k, Token: rec.Token})
					}
				case 6:
					if w == 0 {
						if _, err := s.SweepExpired(ctx, 1+rng.IntN(5)); err != nil {
							t.Error(err)
						}
					}
					clock.Advance(time.Duration(rng.IntN(20)) * time.Second)
				}
			}
		})
	}
	wg.Wait()

	records, index := scan(t, s)
	require.NotEmpty(t, records)
	require.Len(t, index, len(records), "one index entry per record")
	for k, rec := range records {
		exp, ok := index[k]
		require.True(t, ok, "record %q has no index entry", k)
		require.True(t, exp.Equal(rec.ExpiresAt), "index says %v, record %v", exp, rec.ExpiresAt)
	}
}

// scan reads every record and every index entry, keyed by record key.
func scan(t testing.TB, s *Store) (records map[string]storage.Record, index map[string]time.Time) {
	t.Helper()
	records, index = map[string]storage.Record{}, map[string]time.Time{}
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixRecord}, UpperBound: []byte{prefixExpiry + 1}})
	require.NoError(t, err)
	for ok := it.First(); ok; ok = it.Next() {
		switch it.Key()[0] {
		case prefixRecord:
			k, err := decodeRecordKey(it.Key())
			require.NoError(t, err)
			rec := storage.Record{Key: k}
			require.NoError(t, decodeRecord(it.Value(), &rec))
			records[string(it.Key())] = rec
		case prefixExpiry:
			exp, rk, err := decodeExpiryKey(it.Key())
			require.NoError(t, err)
			_, dup := index[string(rk)]
			require.False(t, dup, "two index entries for %q", rk)
			index[string(rk)] = exp
		}
	}
	require.NoError(t, it.Close())
	return records, index
}

func TestSweep(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	ctx := t.Context()

	_, _, ok, err := s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.False(t, ok, "an empty store has no oldest expiry")

	// Expiries 1h, 2h, ... 5h from now, claimed in reverse order.
	var recs []storage.Record
	for i := 5; i >= 1; i-- {
		recs = append([]storage.Record{mustAcquire(t, s, claimP(key(fmt.Sprint(i)), time.Second, time.Duration(i)*time.Hour-time.Second))}, recs...)
	}
	oldest, now, ok, err := s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, recs[0].ExpiresAt, oldest)
	require.Equal(t, clock.Now().UTC(), now)

	res, err := s.SweepExpired(ctx, 10)
	require.NoError(t, err)
	require.Zero(t, res.Deleted, "nothing has expired")

	clock.Advance(3*time.Hour + time.Minute)
	res, err = s.SweepExpired(ctx, 2)
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Equal(t, clock.Now().UTC(), res.Now)
	oldest, _, _, err = s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.Equal(t, recs[2].ExpiresAt, oldest, "the oldest two went first")

	res, err = s.SweepExpired(ctx, 2)
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted, "a short batch: only one more has expired")
	for i, rec := range recs {
		_, err := s.Lookup(ctx, rec.Key)
		if i < 3 {
			require.ErrorIs(t, err, storage.ErrNotFound)
		} else {
			require.NoError(t, err, "a live record is never swept")
		}
	}
	records, index := scan(t, s)
	require.Len(t, records, 2)
	require.Len(t, index, 2)
}

// TestSweepKeepsReclaimed re-claims an expired record between the sweep's
// index scan and its delete: the sweep keeps it.
func TestSweepKeepsReclaimed(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	k := key("k")
	first := mustAcquire(t, s, claimP(k, time.Second, time.Minute))
	clock.Advance(time.Hour)

	var second storage.Record
	s.afterScan = func() { second = mustAcquire(t, s, claimP(k, time.Second, time.Minute)) }
	res, err := s.SweepExpired(t.Context(), 10)
	require.NoError(t, err)
	require.Zero(t, res.Deleted)
	require.Greater(t, second.Token, first.Token)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	require.Equal(t, second, got)
	records, index := scan(t, s)
	require.Len(t, records, 1)
	require.Len(t, index, 1)
}
