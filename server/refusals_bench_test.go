package server_test

import (
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
)

// BenchmarkHeldRefusals measures what the refusals the server holds cost
// it (refusals.go): raw peers without credentials from a few loopback
// sources (127.0.0.2, ...), each connection with 64 Claims refused
// UNAUTHENTICATED, all but a budget of 2 a source held, until the server
// holds MaxHeldRefusals of them; it reports the heap in use and the
// goroutine stacks per held refusal after a collection, and the process's
// resident memory. The raw peers keep nothing per call.
//
//	go test ./server/ -run '^$' -bench BenchmarkHeldRefusals -benchtime 1x
func BenchmarkHeldRefusals(b *testing.B) {
	for range b.N {
		heldRefusalsProbe(b)
	}
}

func heldRefusalsProbe(b *testing.B) {
	src := accessFile(b, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
`)
	reader := sdkmetric.NewManualReader()
	addr, _ := servertest.Serve(b, memStore(b), server.Config{Access: src, RefusalRate: 1, RefusalDelay: time.Hour,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	// Connections of 64 streams (MaxConcurrentStreams) from as many
	// sources as the bound needs, one more than that, and one connection
	// more than they need for the budget (2 a source).
	sources := server.MaxHeldRefusals/server.MaxHeldRefusalsPerCaller + 1
	conns := server.MaxHeldRefusals/60 + 1
	before := memNow()
	var peers []*rawPeer
	for i := range conns {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0." + strconv.Itoa(2+i%sources))}}
		c, err := d.Dial("tcp", addr)
		require.NoError(b, err)
		p := &rawPeer{conn: c, fr: http2.NewFramer(c, c), next: 1}
		p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		_, err = c.Write([]byte(http2.ClientPreface))
		require.NoError(b, err)
		require.NoError(b, p.fr.WriteSettings())
		peers = append(peers, p)
		for range 64 {
			_, err := p.open("/idemreg.v1.RegistryService/Claim", 0, true)
			require.NoError(b, err)
		}
	}
	held := func() int64 {
		var rm metricdata.ResourceMetrics
		require.NoError(b, reader.Collect(b.Context(), &rm))
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == server.MetricRefusalsHeld {
					var n int64
					for _, dp := range d.DataPoints {
						n += dp.Value
					}
					return n
				}
			}
		}
		return 0
	}
	require.Eventually(b, func() bool { return held() == server.MaxHeldRefusals }, time.Minute, 10*time.Millisecond)
	after := memNow()
	n := float64(held())
	b.ReportMetric(n, "held")
	b.ReportMetric(float64(after.heap-before.heap)/n, "heap-B/held")
	b.ReportMetric(float64(after.stack-before.stack)/n, "stack-B/held")
	b.ReportMetric(float64(after.rss-before.rss)/(1<<20), "rss-MiB")
	b.ReportMetric(float64(after.goroutines-before.goroutines), "goroutines")
	for _, p := range peers {
		_ = p.conn.Close()
	}
}
