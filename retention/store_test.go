package retention_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// backend is a store whose clock the test can set. put makes a record of
// the given key expiring at expiresAt; setNow moves the store's clock to t.
type backend struct {
	name  string
	store storage.Store
	put   func(t *testing.T, k storage.Key, expiresAt time.Time)
	// setNow sets the store's clock: exactly on the embedded store; on
	// PostgreSQL to t plus the time from the client computing the offset
	// to the statement's start (never negative, usually well under 1ms).
	setNow func(t time.Time)
	// later is how far after the horizon a record must expire for the test
	// to know it is kept: 1ms where the clock stands still, 1s where it
	// runs (PostgreSQL: the conformance suite checks the horizon there to
	// the millisecond against the horizon each sweep reports).
	later time.Duration
}

const (
	fixtureLease     = 10 * time.Second
	fixtureRetention = time.Hour
)

func backends(t *testing.T) []backend {
	// The embedded store on a clock that stands still.
	var (
		mu  sync.Mutex
		now = time.Now().UTC().Truncate(time.Microsecond)
	)
	peb, err := pebble.Open("", pebble.WithInMemory(), pebble.WithClock(func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = peb.Close() })
	setPebbleNow := func(t time.Time) { mu.Lock(); now = t; mu.Unlock() }

	// PostgreSQL, its clock moved by an offset computed at every call.
	var (
		pgMu     sync.Mutex
		pgTarget time.Time // zero: the database's own clock
	)
	dbURL := pgtest.NewDatabase(t)
	pg, err := postgres.Open(t.Context(), dbURL, postgres.WithClockOffset(func() time.Duration {
		pgMu.Lock()
		defer pgMu.Unlock()
		if pgTarget.IsZero() {
			return 0
		}
		return time.Until(pgTarget)
	}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Close() })

	return []backend{
		{
			name:  "pebble",
			store: peb,
			put: func(t *testing.T, k storage.Key, expiresAt time.Time) {
				mu.Lock()
				saved := now
				now = expiresAt.Add(-fixtureLease - fixtureRetention)
				mu.Unlock()
				defer setPebbleNow(saved)
				res, err := peb.Claim(t.Context(), storage.ClaimParams{Key: k, Lease: fixtureLease, Retention: fixtureRetention})
				require.NoError(t, err)
				require.True(t, res.Record.ExpiresAt.Equal(expiresAt))
			},
			setNow: setPebbleNow,
			later:  time.Millisecond,
		},
		{
			name:  "postgres",
			store: pg,
			put: func(t *testing.T, k storage.Key, expiresAt time.Time) {
				// One row at an exact expiry, as insertRecords makes them.
				insertRecords(t.Context(), t, dbURL, k.Consumer+"/"+k.Key, 1, false,
					fmt.Sprintf("TIMESTAMPTZ '%s' + i * interval '0 second'", expiresAt.Format(time.RFC3339Nano)))
			},
			setNow: func(t time.Time) { pgMu.Lock(); pgTarget = t; pgMu.Unlock() },
			later:  time.Second,
		},
	}
}

// TestSweepAroundTheHorizon puts records just either side of the store's
// clock and checks that a pass in small batches deletes exactly the expired
// ones, the same on every backend.
func TestSweepAroundTheHorizon(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			horizon := time.Now().UTC().Truncate(time.Millisecond).Add(-24 * time.Hour)
			var expired, kept []storage.Key
			n := 0
			put := func(at time.Time, keep bool) {
				n++
				k := storage.Key{Consumer: "horizon." + b.name, Kind: storage.KindMessage, Key: fmt.Sprintf("k%03d", n)}
				b.put(t, k, at)
				if keep {
					kept = append(kept, k)
				} else {
					expired = append(expired, k)
				}
			}
			for i := range 20 {
				put(horizon.Add(-time.Hour-time.Duration(i)*time.Minute), false) // long expired
			}
			put(horizon.Add(-time.Millisecond), false) // expired a millisecond ago
			put(horizon, false)                        // expires_at = now counts as expired
			put(horizon.Add(b.later), true)            // expiring a moment later
			for i := range 5 {
				put(horizon.Add(time.Hour+time.Duration(i)*time.Minute), true) // far off
			}
			b.setNow(horizon)
			t.Cleanup(func() { b.setNow(time.Time{}) })

			sw, err := retention.New(b.store.(storage.Sweeper), retention.Config{BatchSize: 5, Pause: -1})
			require.NoError(t, err)
			res, err := sw.Once(t.Context())
			require.NoError(t, err)
			require.Equal(t, retention.StopFinished, res.Stop)
			require.EqualValues(t, len(expired), res.Deleted)
			require.Equal(t, len(expired)/5+1, res.Batches, "full batches, then a short one")
			require.True(t, res.HasOldest)
			require.True(t, res.Oldest.Equal(horizon.Add(b.later)), "the first record left is the one expiring just after the horizon: %v", res.Oldest)
			require.Zero(t, res.Lag())

			// The same pass again deletes nothing; moving the clock past the
			// next record lets it go, and only it.
			res, err = sw.Once(t.Context())
			require.NoError(t, err)
			require.Zero(t, res.Deleted)
			b.setNow(horizon.Add(b.later))
			res, err = sw.Once(t.Context())
			require.NoError(t, err)
			require.EqualValues(t, 1, res.Deleted)
			require.True(t, res.Oldest.Equal(horizon.Add(time.Hour)))
		})
	}
}

// TestSweepKeepsLiveLeases claims records with a long lease and no more
// than the shortest retention: the lease keeps them however long ago they
// were claimed.
func TestSweepKeepsLiveLeases(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx := t.Context()
			var keys []storage.Key
			for i := range 10 {
				k := storage.Key{Consumer: "leases." + b.name, Kind: storage.KindOperation, Key: fmt.Sprint(i)}
				_, err := b.store.Claim(ctx, storage.ClaimParams{Key: k, Lease: time.Hour, Retention: time.Minute})
				require.NoError(t, err)
				keys = append(keys, k)
			}
			b.setNow(time.Now().Add(59 * time.Minute))
			t.Cleanup(func() { b.setNow(time.Time{}) })
			sw, err := retention.New(b.store.(storage.Sweeper), retention.Config{BatchSize: 3, Pause: -1})
			require.NoError(t, err)
			res, err := sw.Once(ctx)
			require.NoError(t, err)
			require.Zero(t, res.Deleted)
			for _, k := range keys {
				_, err := b.store.Lookup(ctx, k)
				require.NoError(t, err, "an in-progress record with a live lease is kept")
			}
			b.setNow(time.Now().Add(time.Hour + 2*time.Minute))
			res, err = sw.Once(context.WithoutCancel(ctx))
			require.NoError(t, err)
			require.EqualValues(t, len(keys), res.Deleted)
		})
	}
}
