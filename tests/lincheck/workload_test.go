package lincheck

import (
	"context"
	"errors"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

func memStore(t *testing.T) storage.Store {
	t.Helper()
	s, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(slog.New(slog.DiscardHandler)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func runWorkload(t *testing.T, conn *grpc.ClientConn, d time.Duration, opts ...func(*Config)) (*Workload, *Recorder) {
	t.Helper()
	rec := NewRecorder()
	cfg := Config{Clients: 6, Keys: 2, Rotate: 300 * time.Millisecond, Seed: 1}
	for _, o := range opts {
		o(&cfg)
	}
	w := NewWorkload(conn, rec, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	w.Run(ctx)
	require.Empty(t, w.Unexpected())
	require.Empty(t, w.Verify(t.Context()))
	return w, rec
}

// TestWorkloadOnEmbeddedStore records a short history against the real
// server on the in-memory embedded store and checks it: the cheap version
// of the fault-injecting runs in tests/faults, run by every `go test`.
func TestWorkloadOnEmbeddedStore(t *testing.T) {
	_, rec := runWorkload(t, servertest.Start(t, memStore(t), server.Config{}), 1500*time.Millisecond)
	h, st := rec.History()
	t.Log(st)
	require.Greater(t, st.ByStatus[Acquired], 10)
	require.Greater(t, st.ByStatus[OK], 10)
	require.Greater(t, st.ByStatus[InProgress]+st.ByStatus[Completed], 10)
	require.Greater(t, st.ByStatus[LeaseLost], 0)
	require.Greater(t, st.Batches, 10)
	require.Greater(t, st.SameKey, 0, "a batch names a key twice now and then")
	require.Greater(t, st.Woken, 0, "a waiting Claim is woken by a Complete or a Release")
	require.Greater(t, st.Waits, st.Woken, "a waiting Claim's wait elapses now and then")
	require.NoError(t, Check(h, time.Minute, filepath.Join(t.TempDir(), "history.html")))
}

// TestWorkloadThroughClient is TestWorkloadOnEmbeddedStore with the single
// Claims and Completes sent through the Go client, whose concurrent calls
// share Batch RPCs: the history stays linearizable.
func TestWorkloadThroughClient(t *testing.T) {
	addr, _ := servertest.Serve(t, memStore(t), server.Config{})
	var shared atomic.Int64
	conn := servertest.Dial(t, addr, grpc.WithChainUnaryInterceptor(
		func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			switch r := req.(type) {
			case *idemregv1.BatchRequest: // Claims and Completes of one queue
				if len(r.GetItems()) > 1 {
					shared.Add(1)
				}
			case *idemregv1.BatchClaimRequest: // a registry without Batch
				if len(r.GetRequests()) > 1 {
					shared.Add(1)
				}
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}))
	_, rec := runWorkload(t, conn, 1500*time.Millisecond, func(c *Config) { c.ThroughClient, c.Batch, c.Clients = true, -1, 16 })
	h, st := rec.History()
	t.Log(st, "; shared RPCs the client sent:", shared.Load())
	require.Greater(t, st.ByStatus[Acquired], 10)
	require.Greater(t, st.ByStatus[OK], 10)
	require.Greater(t, shared.Load(), int64(0), "concurrent Claims shared RPCs")
	require.NoError(t, Check(h, time.Minute, filepath.Join(t.TempDir(), "history.html")))
}

// doubleOwner is a broken store: now and then it hands a key whose lease is
// live to a second caller.
type doubleOwner struct {
	storage.Store
	n atomic.Int64
}

func (s *doubleOwner) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, p)
	if err == nil && res.Outcome == storage.OutcomeInProgress && s.n.Add(1)%5 == 0 {
		res = storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: res.Record}
	}
	return res, err
}

// staleWriter is a broken store whose Complete does not check the token.
type staleWriter struct{ storage.Store }

func (s *staleWriter) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	if rec, err := s.Store.Lookup(ctx, p.Key); err == nil && rec.State == storage.StateInProgress {
		p.Token = rec.Token
	}
	return s.Store.Complete(ctx, p)
}

// reversedBatches is a broken store that decides the items of a batch in
// reverse order: two items on one key see each other's effect the wrong
// way round, which the items' shared interval alone would allow.
type reversedBatches struct{ storage.Store }

func (s *reversedBatches) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	out := make([]storage.ClaimAnswer, len(ps))
	for i := len(ps) - 1; i >= 0; i-- {
		out[i].Result, out[i].Err = s.Claim(ctx, ps[i])
	}
	return out
}

func (s *reversedBatches) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	out := make([]storage.CompleteAnswer, len(ps))
	for i := len(ps) - 1; i >= 0; i-- {
		out[i].Record, out[i].Err = s.Complete(ctx, ps[i])
	}
	return out
}

// TestCheckerCatchesBrokenStores shows that the checker fails a run on a
// registry that breaks the contract, and writes the visualisation. A
// broken answer needs the right interleaving, which a short run on a busy
// machine may not produce: each store gets up to ten one-second runs, each
// on a fresh store with its own seed, and must be caught in one of them.
func TestCheckerCatchesBrokenStores(t *testing.T) {
	for name, wrap := range map[string]func(storage.Store) storage.Store{
		"two owners":           func(s storage.Store) storage.Store { return &doubleOwner{Store: s} },
		"stale Complete":       func(s storage.Store) storage.Store { return &staleWriter{Store: s} },
		"batch items reversed": func(s storage.Store) storage.Store { return &reversedBatches{Store: s} },
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "history.html")
			var err error
			for run := range 10 {
				rec := NewRecorder()
				w := NewWorkload(servertest.Start(t, wrap(memStore(t)), server.Config{}), rec, Config{Clients: 6, Keys: 2, Rotate: 300 * time.Millisecond, Seed: uint64(2 + run)})
				ctx, cancel := context.WithTimeout(t.Context(), time.Second)
				w.Run(ctx)
				cancel()
				h, _ := rec.History()
				if err = Check(h, time.Minute, path); errors.Is(err, ErrNotLinearizable) {
					t.Logf("caught in run %d", run+1)
					break
				}
			}
			require.ErrorIs(t, err, ErrNotLinearizable)
			require.FileExists(t, path)
		})
	}
}
