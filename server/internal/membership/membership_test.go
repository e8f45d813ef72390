package membership_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/membership"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

func openStore(t *testing.T, url string) *postgres.Store {
	t.Helper()
	s, err := postgres.Open(t.Context(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func ids(ms []storage.Member) []string {
	out := []string{}
	for _, m := range ms {
		out = append(out, m.ID)
	}
	return out
}

// TestReplicasFindEachOther: two replicas on one database, each with a
// store of its own, see each other after a beat each, with the address
// each advertised; a replica that stops leaves, and the other no longer
// counts it after its next beat.
func TestReplicasFindEachOther(t *testing.T) {
	url := pgtest.NewDatabase(t)
	a := membership.New(openStore(t, url), membership.Config{ID: "a", Address: "10.0.0.1:9090"})
	b := membership.New(openStore(t, url), membership.Config{ID: "b", Address: "10.0.0.2:9090"})
	require.Equal(t, 1, a.Count(), "before any read, a replica counts itself")
	a.Beat(t.Context())
	b.Beat(t.Context())
	a.Beat(t.Context())
	require.Equal(t, []string{"a", "b"}, ids(a.Live()))
	require.Equal(t, []string{"a", "b"}, ids(b.Live()))
	require.Equal(t, 2, a.Count())
	addr, ok := a.Address("b")
	require.True(t, ok)
	require.Equal(t, "10.0.0.2:9090", addr)
	require.False(t, a.Stale())

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { b.Run(ctx); close(done) }()
	<-b.Ready()
	cancel()
	<-done // Run left the membership as it ended
	a.Beat(t.Context())
	require.Equal(t, []string{"a"}, ids(a.Live()))
	_, ok = a.Address("b")
	require.False(t, ok)
	require.Equal(t, 1, a.Count())
}

// TestFailedBeatKeepsTheView: a beat that cannot reach the store keeps the
// last view rather than emptying it.
func TestFailedBeatKeepsTheView(t *testing.T) {
	url := pgtest.NewDatabase(t)
	s := openStore(t, url)
	a := membership.New(s, membership.Config{ID: "a", Address: "x:1"})
	a.Beat(t.Context())
	require.Equal(t, []string{"a"}, ids(a.Live()))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	a.Beat(ctx)
	require.Equal(t, []string{"a"}, ids(a.Live()))
}

func TestNewIDUnique(t *testing.T) {
	require.NotEqual(t, membership.NewID(), membership.NewID())
}
