package lincheck

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
)

func runConsumerWorkload(t *testing.T, store storage.Store, d time.Duration) *ConsumerWorkload {
	t.Helper()
	w := NewConsumerWorkload(servertest.Start(t, store, server.Config{}), ConsumerConfig{Seed: 1})
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	w.Run(ctx)
	t.Log(w.Stats())
	return w
}

// TestConsumerWorkloadOnEmbeddedStore runs the consumer workload against
// the real server on the in-memory embedded store, without faults: every
// acknowledged message replays its outcome. The SIGKILL runs are in
// consumer_serve_test.go (tag linearizability).
//
// It runs 3 s: a run of 1 s acknowledged 19 messages, under the bound, on a
// machine at load 40.
func TestConsumerWorkloadOnEmbeddedStore(t *testing.T) {
	w := runConsumerWorkload(t, memStore(t), 3*time.Second)
	require.Empty(t, w.Unexpected())
	require.Empty(t, w.Verify(t.Context()))
	require.Greater(t, w.Acknowledged(), 20)
}

// forgetfulStore is a broken store that answers a Complete as stored
// without storing it.
type forgetfulStore struct{ storage.Store }

func (s *forgetfulStore) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	rec, err := s.Store.Lookup(ctx, p.Key)
	if err != nil {
		return rec, err
	}
	rec.State, rec.Result = storage.StateCompleted, p.Result
	return rec, nil
}

// TestConsumerWorkloadCatchesLostCompletes shows that Verify fails a run
// whose acknowledged Completes were not stored.
func TestConsumerWorkloadCatchesLostCompletes(t *testing.T) {
	w := runConsumerWorkload(t, &forgetfulStore{Store: memStore(t)}, 300*time.Millisecond)
	require.NotEmpty(t, w.Verify(t.Context()))
}
