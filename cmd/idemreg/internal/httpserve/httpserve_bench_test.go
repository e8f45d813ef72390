package httpserve

import (
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkHTTPIdleConnections is the bounded probe of issue 25's finding
// 7: 5,000 connections to an HTTP listener of serve that never send a
// request, with the default bounds and without a cap (as on main), and
// what the process holds for them: heap in use and stacks after a
// collection, goroutines, resident memory. One process, so the resident
// memory includes the client's side of each connection (a file
// descriptor and a few hundred bytes).
//
//	go test ./cmd/idemreg/ -run '^$' -bench BenchmarkHTTPIdleConnections -benchtime 1x
func BenchmarkHTTPIdleConnections(b *testing.B) {
	uncapped := DefaultBounds()
	uncapped.MaxConnections, uncapped.MaxConnectionsPerSource = 1<<30, 1<<30
	for _, tc := range []struct {
		name   string
		bounds Bounds
	}{{"default", DefaultBounds()}, {"uncapped", uncapped}} {
		b.Run(tc.name, func(b *testing.B) {
			for range b.N {
				idleConnectionsProbe(b, tc.bounds, 5000)
			}
		})
	}
}

func idleConnectionsProbe(b *testing.B, bounds Bounds, n int) {
	stop, addr, err := Serve("probe", "127.0.0.1:0", http.NotFoundHandler(), bounds, slog.New(slog.DiscardHandler))
	require.NoError(b, err)
	defer stop()
	before := processMemory()
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := net.Dial("tcp", addr.String())
		require.NoError(b, err)
		conns = append(conns, c)
	}
	// Until the server has accepted (or closed) them all: the goroutine
	// count settles.
	for last := -1; ; time.Sleep(100 * time.Millisecond) {
		if g := runtime.NumGoroutine(); g == last {
			break
		} else {
			last = g
		}
	}
	held := processMemory()
	b.ReportMetric(float64(held.goroutines-before.goroutines), "goroutines")
	b.ReportMetric(float64(held.heap-before.heap)/(1<<20), "heap-MiB")
	b.ReportMetric(float64(held.stack-before.stack)/(1<<20), "stack-MiB")
	b.ReportMetric(float64(held.rss-before.rss)/(1<<20), "rss-MiB")
}

type memorySample struct{ heap, stack, rss, goroutines int64 }

func processMemory() memorySample {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := memorySample{heap: int64(ms.HeapInuse), stack: int64(ms.StackInuse), goroutines: int64(runtime.NumGoroutine())}
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
