package server_test

import (
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// BenchmarkBatchPerItem measures what one item of a batch costs (issue
// 36, item 2: a batch of 4 cost about 320 µs of CPU per key where the fit
// through unary calls and batches of 64 says 190): BatchClaim of new keys
// and BatchComplete of them, batches of 1, 4 and 16, beside the unary
// Claim and Complete, over real gRPC on loopback, 8 callers on one
// connection, against the in-memory embedded store (no disk), the logger
// at WARN. An op is one key claimed and completed. cpu-µs/item is the
// process's CPU (callers and server alike: both are here) per key and
// call, so a Claim and a Complete of a key count two; allocs/item, the
// allocations per key and call, which do not depend on what else the
// machine runs. Across the sizes, a fixed cost per RPC shows as a share
// that falls with the batch; what stays is the per-item cost.
//
//	go test -run '^$' -bench BatchPerItem -count 3 ./server/
//	go test -run '^$' -bench 'BatchPerItem/batch=4' -cpuprofile /tmp/cpu.pprof -memprofile /tmp/mem.pprof ./server/
func BenchmarkBatchPerItem(b *testing.B) {
	for _, size := range []int{0, 1, 4, 16} {
		name := "unary"
		if size > 0 {
			name = "batch=" + strconv.Itoa(size)
		}
		b.Run(name, func(b *testing.B) { benchBatch(b, size) })
	}
}

// benchBatch is one size of BenchmarkBatchPerItem; size 0 is the unary
// calls.
func benchBatch(b *testing.B, size int) {
	logger := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(logger))
	require.NoError(b, err)
	b.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(b, store, server.Config{Logger: logger})
	c := idemregv1.NewRegistryServiceClient(servertest.Dial(b, addr))
	prefix := strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	lease, retention := durationpb.New(30*time.Second), durationpb.New(time.Hour)
	result := &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "bench.v1.Done", Data: make([]byte, 64)}}}
	claim := func(key string) *idemregv1.ClaimRequest {
		return &idemregv1.ClaimRequest{Consumer: "bench", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
			Lease: lease, Retention: retention, Holder: "bench"}
	}
	complete := func(key string, token int64, secret []byte) *idemregv1.CompleteRequest {
		return &idemregv1.CompleteRequest{Consumer: "bench", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
			Token: token, ClaimSecret: secret, Result: result}
	}
	per := max(size, 1) // keys an iteration handles
	var seq atomic.Int64

	b.SetParallelism(max(8/runtime.GOMAXPROCS(0), 1)) // 8 callers
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	cpu0 := cpuTime()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := b.Context()
		keys := make([]string, per)
		for {
			// An iteration is per keys: as many ops as it has keys.
			n := 0
			for n < per && pb.Next() {
				n++
			}
			if n == 0 {
				return
			}
			first := seq.Add(int64(n)) - int64(n)
			for i := range n {
				keys[i] = prefix + strconv.FormatInt(first+int64(i), 10)
			}
			if size == 0 {
				res, err := c.Claim(ctx, claim(keys[0]))
				if err != nil {
					b.Error(err)
					return
				}
				if _, err := c.Complete(ctx, complete(keys[0], res.GetToken(), res.GetClaimSecret())); err != nil {
					b.Error(err)
					return
				}
				continue
			}
			creq := &idemregv1.BatchClaimRequest{Requests: make([]*idemregv1.ClaimRequest, n)}
			for i := range n {
				creq.Requests[i] = claim(keys[i])
			}
			cres, err := c.BatchClaim(ctx, creq)
			if err != nil {
				b.Error(err)
				return
			}
			dreq := &idemregv1.BatchCompleteRequest{Requests: make([]*idemregv1.CompleteRequest, n)}
			for i, item := range cres.GetResults() {
				r := item.GetResponse()
				if r.GetOutcome() != idemregv1.Outcome_OUTCOME_ACQUIRED {
					b.Errorf("item %d: %v", i, item)
					return
				}
				dreq.Requests[i] = complete(keys[i], r.GetToken(), r.GetClaimSecret())
			}
			dres, err := c.BatchComplete(ctx, dreq)
			if err != nil {
				b.Error(err)
				return
			}
			for i, item := range dres.GetResults() {
				if item.GetError() != nil {
					b.Errorf("item %d: %v", i, item.GetError())
					return
				}
			}
		}
	})
	b.StopTimer()
	cpu := cpuTime() - cpu0
	runtime.ReadMemStats(&ms1)
	calls := float64(2 * b.N) // a key's Claim and its Complete
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "keys/s")
	b.ReportMetric(float64(cpu.Microseconds())/calls, "cpu-µs/item")
	b.ReportMetric(float64(ms1.Mallocs-ms0.Mallocs)/calls, "allocs/item")
	b.ReportMetric(float64(ms1.TotalAlloc-ms0.TotalAlloc)/calls, "B/item")
}
