package server_test

import (
	"context"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/server"
)

// BenchmarkHeldCalls is the bounded probe of issue 25's finding 1: peers
// that open calls with headers at the header bound on both listeners (the
// gRPC one and the health one) and never send the request message. It
// holds heldConns connections per listener, each with as many such calls
// as the server accepts (at most MaxConcurrentStreams), and reports what
// the server holds for them: the heap in use and the goroutine stacks
// after a collection, and the process's resident memory, per call
// accepted and in all. Loopback, one process: client and server share the
// heap, but the raw peer keeps nothing per call (it writes and forgets).
//
//	go test ./server/ -run '^$' -bench BenchmarkHeldCalls -benchtime 1x
func BenchmarkHeldCalls(b *testing.B) {
	for _, conns := range []int{4, 16, 128} {
		for _, field := range []int{4 << 10, 64} {
			b.Run("conns="+strconv.Itoa(conns)+"/field="+strconv.Itoa(field), func(b *testing.B) {
				for range b.N {
					heldCallsProbe(b, conns, field)
				}
			})
		}
	}
}

func heldCallsProbe(b *testing.B, heldConns, field int) {
	bounds := server.DefaultBounds()
	srv, err := server.New(memStore(b), server.Config{HealthInterval: time.Hour, Bounds: bounds})
	require.NoError(b, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	hlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	healthDone := make(chan error, 1)
	go func() { healthDone <- srv.ServeHealth(hlis) }()
	defer func() {
		cancel()
		require.NoError(b, <-done)
		require.NoError(b, <-healthDone)
	}()
	addrs := []string{lis.Addr().String(), hlis.Addr().String()}
	for _, addr := range addrs {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(b, err)
		_, err = healthpb.NewHealthClient(conn).Check(b.Context(), &healthpb.HealthCheckRequest{Service: server.LivenessService})
		require.NoError(b, err)
		require.NoError(b, conn.Close())
	}
	// Headers just under the bound: the pad, the call's own fields and 32
	// bytes of overhead per field ("x-pad-N" names).
	pad := int(bounds.MaxHeaderListSize) - 600
	pad -= (pad / field) * (32 + 10)
	before := memNow()
	var peers []*rawPeer
	accepted, refused := 0, 0
	// From several sources (127.0.0.2, ...), none at the health
	// listener's MaxHealthConnectionsPerSource, which closes a source's
	// connections beyond it at once: the probe measures what the held
	// calls of many connections cost, as peers behind many addresses
	// would hold them.
	sources := heldConns/bounds.MaxHealthConnectionsPerSource + 1
	for _, addr := range addrs {
		for i := range heldConns {
			p := dialRawFrom(b, addr, "127.0.0."+strconv.Itoa(2+i%sources))
			peers = append(peers, p)
			n := int(bounds.MaxConcurrentStreams)
			for range n {
				_, err := p.openFields("/grpc.health.v1.Health/Check", pad, field, false)
				require.NoError(b, err)
			}
			answers, err := p.resetsBefore()
			require.NoError(b, err)
			// A stream the server refused (REFUSED_STREAM, or a status
			// at once) is not held.
			accepted += n - len(answers)
			refused += len(answers)
		}
	}
	held := memNow()
	b.StopTimer()
	perCall := func(x, y int64) float64 {
		if accepted == 0 {
			return 0
		}
		return float64(y-x) / float64(accepted)
	}
	b.ReportMetric(float64(accepted), "held-calls")
	b.ReportMetric(float64(refused), "refused-calls")
	b.ReportMetric(perCall(before.heap, held.heap), "heap-B/call")
	b.ReportMetric(perCall(before.stack, held.stack), "stack-B/call")
	b.ReportMetric(perCall(before.rss, held.rss), "rss-B/call")
	b.ReportMetric(float64(held.heap-before.heap)/(1<<20), "heap-MiB")
	b.ReportMetric(float64(held.rss-before.rss)/(1<<20), "rss-MiB")
	b.ReportMetric(float64(held.goroutines-before.goroutines), "goroutines")
	for _, p := range peers {
		_ = p.conn.Close()
	}
}

type memSample struct{ heap, stack, rss, goroutines int64 }

// memNow is the heap in use and the stacks after a collection, and the
// resident set from /proc (0 where there is none).
func memNow() memSample {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := memSample{heap: int64(ms.HeapInuse), stack: int64(ms.StackInuse), goroutines: int64(runtime.NumGoroutine())}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				s.rss = kb << 10
			}
		}
	}
	return s
}
