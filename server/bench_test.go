package server_test

import (
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// BenchmarkServerClaimComplete measures the server's own cost: a Claim of a
// new key and its Complete, over real gRPC on loopback, 64 callers on one
// connection, against the in-memory embedded store (no disk), with the
// logger at WARN as in production. An op is one pair. Besides ns/op it
// reports the process's CPU per call (client and server: both are here)
// and, with -benchmem, the allocations per pair, which do not depend on
// what else the machine runs.
//
//	go test -run '^$' -bench ServerClaimComplete -benchmem -count 5 ./server/
func BenchmarkServerClaimComplete(b *testing.B) { benchClaimComplete(b, nil) }

// BenchmarkTracedClaimComplete is BenchmarkServerClaimComplete with every
// call traced (an SDK provider that samples all and exports nowhere): what
// tracing costs, otelgrpc's span, the call's attributes and the store span.
//
//	go test -run '^$' -bench TracedClaimComplete -benchmem -count 5 ./server/
func BenchmarkTracedClaimComplete(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
	b.Cleanup(func() { _ = tp.Shutdown(b.Context()) })
	benchClaimComplete(b, tp)
}

// benchClaimComplete is BenchmarkServerClaimComplete with the tracer
// provider tp (nil: the global one, a no-op).
func benchClaimComplete(b *testing.B, tp trace.TracerProvider) {
	logger := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(logger))
	require.NoError(b, err)
	b.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(b, store, server.Config{Logger: logger, TracerProvider: tp})
	conn := servertest.Dial(b, addr)
	c := idemregv1.NewRegistryServiceClient(conn)
	var seq atomic.Int64
	prefix := strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	lease, retention := durationpb.New(30*time.Second), durationpb.New(time.Hour)
	result := &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "bench.v1.Done", Data: make([]byte, 64)}}}

	b.SetParallelism(max(64/runtime.GOMAXPROCS(0), 1)) // 64 callers
	cpu0 := cpuTime()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := b.Context()
		for pb.Next() {
			key := prefix + strconv.FormatInt(seq.Add(1), 10)
			res, err := c.Claim(ctx, &idemregv1.ClaimRequest{
				Consumer: "bench", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
				Lease: lease, Retention: retention, Holder: "bench",
			})
			if err != nil {
				b.Error(err)
				return
			}
			if _, err := c.Complete(ctx, &idemregv1.CompleteRequest{
				Consumer: "bench", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key, Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Result: result,
			}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
	b.ReportMetric(float64((cpuTime()-cpu0).Microseconds())/float64(2*b.N), "cpu-µs/call")
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// countingWriter counts the bytes written to it.
type countingWriter struct{ n atomic.Int64 }

func (w *countingWriter) Write(p []byte) (int, error) { w.n.Add(int64(len(p))); return len(p), nil }

// BenchmarkRefusedCall measures what a refused call costs the server (issue
// 25, finding 9: a flood of refusals slowed every other tenant): a Claim
// refused before the store, over real gRPC on loopback, 64 callers on one
// connection, the logger at INFO (serve's default) into a counter. Besides
// ns/op it reports the process's CPU per call and the access log's bytes
// per call; with -benchmem, the allocations per call (client's included).
//
//	go test -run '^$' -bench RefusedCall -benchmem -count 5 ./server/
func BenchmarkRefusedCall(b *testing.B) {
	src := accessFile(b, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
rate_limits:
  - consumers: ["team.limited"]
    rate: 0.001
    burst: 1
`)
	for _, bc := range []struct {
		name     string
		token    string
		consumer string
	}{
		{"unauthenticated", "wrong-token", "team.a"},
		{"permission_denied", "team-token", "other.a"},
		{"rate_limited", "team-token", "team.limited"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var logs countingWriter
			logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
			store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(slog.New(slog.DiscardHandler)))
			require.NoError(b, err)
			b.Cleanup(func() { _ = store.Close() })
			addr, _ := servertest.Serve(b, store, server.Config{Logger: logger, Access: src})
			c := idemregv1.NewRegistryServiceClient(servertest.Dial(b, addr))
			ctx := metadata.AppendToOutgoingContext(b.Context(), "authorization", "bearer "+bc.token)
			req := &idemregv1.ClaimRequest{Consumer: bc.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"}
			_, _ = c.Claim(ctx, req) // spend the burst of team.limited
			logs.n.Store(0)

			b.SetParallelism(max(64/runtime.GOMAXPROCS(0), 1))
			cpu0 := cpuTime()
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := c.Claim(ctx, req); status.Code(err) == codes.OK {
						b.Error("not refused")
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
			b.ReportMetric(float64((cpuTime()-cpu0).Microseconds())/float64(b.N), "cpu-µs/call")
			b.ReportMetric(float64(logs.n.Load())/float64(b.N), "log-B/call")
		})
	}
}

// BenchmarkNeighbourOfRefusalFlood measures what a flood of refused calls
// from one identity costs another (issue 25, finding 9: another team's
// throughput fell from 1,684 to 411 calls/s): team's Claims of new keys,
// 8 callers, alone and beside 64 callers of flood sending Claims of a
// consumer it may not use as fast as they are answered, on one server with
// the logger at INFO writing JSON to a file. An op is one of team's Claims;
// calls/s is team's, refused/s the flood's. beside_flood holds no refusal
// (RefusalRate 0, as before issue 35); beside_flood_held has serve's
// default, DefaultRefusalRate, beyond which flood's refusals are held;
// beside_wide_flood_held is flood with 256 callers over 4 connections.
//
//	go test -run '^$' -bench NeighbourOfRefusalFlood -benchtime 3s ./server/
func BenchmarkNeighbourOfRefusalFlood(b *testing.B) {
	src := accessFile(b, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
  - {name: flood, token_hashes: ["`+access.HashToken("flood-token")+`"], consumers: ["flood.*"]}
rate_limits: # team measures its throughput: above the default rate of an identity
  - {identities: [team], rate: 1000000000, burst: 1000000000}
`)
	for _, bc := range []struct {
		name                string
		flooded             bool
		refusalRate         float64
		floodConns, callers int
	}{
		{"alone", false, server.DefaultRefusalRate, 0, 0},
		{"beside_flood", true, 0, 1, 64},
		{"beside_flood_held", true, server.DefaultRefusalRate, 1, 64},
		{"beside_wide_flood_held", true, server.DefaultRefusalRate, 4, 256},
	} {
		flooded := bc.flooded
		b.Run(bc.name, func(b *testing.B) {
			f, err := os.Create(b.TempDir() + "/log.json")
			require.NoError(b, err)
			b.Cleanup(func() { _ = f.Close() })
			logger := slog.New(slog.NewJSONHandler(f, &slog.HandlerOptions{Level: slog.LevelInfo}))
			store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(slog.New(slog.DiscardHandler)))
			require.NoError(b, err)
			b.Cleanup(func() { _ = store.Close() })
			addr, _ := servertest.Serve(b, store, server.Config{Logger: logger, Access: src, RefusalRate: bc.refusalRate})
			team := idemregv1.NewRegistryServiceClient(servertest.Dial(b, addr))
			var floodConns []idemregv1.RegistryServiceClient
			for range bc.floodConns {
				floodConns = append(floodConns, idemregv1.NewRegistryServiceClient(servertest.Dial(b, addr)))
			}

			stop := make(chan struct{})
			var refused atomic.Int64
			var floods sync.WaitGroup
			if flooded {
				ctx := metadata.AppendToOutgoingContext(b.Context(), "authorization", "bearer flood-token")
				req := &idemregv1.ClaimRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"}
				for i := range bc.callers {
					floodConn := floodConns[i%len(floodConns)]
					floods.Go(func() {
						for {
							select {
							case <-stop:
								return
							default:
							}
							if _, err := floodConn.Claim(ctx, req); status.Code(err) == codes.PermissionDenied {
								refused.Add(1)
							}
						}
					})
				}
			}
			ctx := metadata.AppendToOutgoingContext(b.Context(), "authorization", "bearer team-token")
			var seq atomic.Int64
			prefix := strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
			b.SetParallelism(max(8/runtime.GOMAXPROCS(0), 1))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := team.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE,
						Key: prefix + strconv.FormatInt(seq.Add(1), 10)}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			close(stop)
			floods.Wait()
			info, err := f.Stat()
			require.NoError(b, err)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
			b.ReportMetric(float64(refused.Load())/b.Elapsed().Seconds(), "refused/s")
			b.ReportMetric(float64(info.Size())/float64(1<<20), "log-MiB")
		})
	}
}
