package pebble

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

func openT(t testing.TB, dir string, opts ...Option) *Store {
	t.Helper()
	s, err := Open(dir, append([]Option{WithLogger(testLogger(t))}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// fakeClock is a clock that moves only when told to, backwards included.
type fakeClock struct{ ns atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC).UnixNano())
	return c
}

func (c *fakeClock) Now() time.Time { return time.Unix(0, c.ns.Load()) }

func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

func key(name string) storage.Key {
	return storage.Key{Consumer: "test", Kind: storage.KindOperation, Key: name}
}

func claimP(k storage.Key, lease, retention time.Duration) storage.ClaimParams {
	return storage.ClaimParams{Key: k, Lease: lease, Retention: retention, Holder: "h"}
}

func mustAcquire(t testing.TB, s *Store, p storage.ClaimParams) storage.Record {
	t.Helper()
	res, err := s.Claim(context.Background(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record
}

func mustComplete(t testing.TB, s *Store, k storage.Key, token int64, result string) storage.Record {
	t.Helper()
	rec, err := s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: token, Result: []byte(result)})
	require.NoError(t, err)
	return rec
}
