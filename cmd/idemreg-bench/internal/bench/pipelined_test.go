package bench

import (
	"context"
	"path"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// rpcCounter counts a connection's RPCs by method.
type rpcCounter struct {
	mu    sync.Mutex
	calls map[string]int
}

func (c *rpcCounter) option() grpc.DialOption {
	return grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		c.mu.Lock()
		c.calls[path.Base(method)]++
		c.mu.Unlock()
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// TestPipelinedTargets drives both -pipelined targets on PostgreSQL (the
// registry's store and the baseline's table) with 1 and 4 callers: every
// pair acquired and completed, no held Complete failed. It logs the
// registry's RPCs per message; it asserts none of the unary calls were
// made (every Claim and Complete went in a Batch), never a count that
// depends on timing.
func TestPipelinedTargets(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	store, err := postgres.Open(t.Context(), databaseURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(t, store, server.Config{Limits: server.DefaultLimits()})

	for _, callers := range []int{1, 4} {
		cfg := Config{Callers: callers, Count: 300, KeyPrefix: t.Name() + "-" + string(rune('a'+callers)) + "-", Result: []byte("done")}

		counter := &rpcCounter{calls: map[string]int{}}
		reg, err := NewRegistryPipelined(addr, "bench.pipelined", counter.option())
		require.NoError(t, err)
		res, err := Run(t.Context(), reg, cfg)
		require.NoError(t, err)
		require.NoError(t, reg.Close(), "every held Complete durable")
		require.Zero(t, res.Errors, res.FirstError)
		require.Zero(t, res.Unexpected, res.FirstError)
		require.Equal(t, cfg.Count, res.Pairs)
		counter.mu.Lock()
		calls := counter.calls
		counter.mu.Unlock()
		require.Zero(t, calls["Claim"]+calls["Complete"]+calls["BatchClaim"]+calls["BatchComplete"], "%v", calls)
		t.Logf("idemreg-pipelined, %d callers: %d messages, %d Batch RPCs (%.2f per message), %.0f pairs/s, claim p50 %v",
			callers, res.Pairs, calls["Batch"], float64(calls["Batch"])/float64(res.Pairs), res.PairsPerSecond(), res.Claim.P50)

		plain, err := NewRegistryClient(addr, "bench.plain", client.Batching{})
		require.NoError(t, err)
		res, err = Run(t.Context(), plain, cfg)
		require.NoError(t, err)
		require.NoError(t, plain.Close())
		t.Logf("idemreg (Claim, then Complete), %d callers: %.0f pairs/s, claim p50 %v, complete p50 %v", callers, res.PairsPerSecond(), res.Claim.P50, res.Complete.P50)

		sql, err := NewSQLPipelined(t.Context(), databaseURL, "bench.sql-pipelined", callers)
		require.NoError(t, err)
		res, err = Run(t.Context(), sql, cfg)
		require.NoError(t, err)
		require.NoError(t, sql.Close(), "every held Complete durable")
		require.Zero(t, res.Errors, res.FirstError)
		require.Zero(t, res.Unexpected, res.FirstError)
		require.Equal(t, cfg.Count, res.Pairs)
		t.Logf("sql-pipelined, %d callers: %d messages, %.0f pairs/s, claim p50 %v", callers, res.Pairs, res.PairsPerSecond(), res.Claim.P50)
	}
}
