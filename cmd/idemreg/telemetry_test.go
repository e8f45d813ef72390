package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	colmetricspb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/versioncmd"
	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

func scrape(t *testing.T, addr string) string {
	t.Helper()
	res, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	return string(body)
}

// TestServeTelemetry: what an SRE sees of a fresh serve. The startup line
// names the build and the store; /metrics has idemreg_build_info,
// service.version on target_info, no otel_scope_* labels, and every
// counter at 0 before its first event; after a few Claims, the call
// duration's buckets under 5 ms are populated.
func TestServeTelemetry(t *testing.T) {
	bin := servetest.Binary(t)
	metricsAddr := servetest.FreeAddr(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--metrics-listen", metricsAddr)
	start := p.WaitLog(t, "starting idemreg")
	require.Equal(t, "embedded", start["store"])
	require.Equal(t, runtime.Version(), start["go_version"])
	require.NotEmpty(t, start["version"])
	require.NotEmpty(t, start["revision"])
	p.WaitLog(t, "serving")

	fresh := scrape(t, metricsAddr)
	require.Regexp(t, `idemreg_build_info\{goversion="`+regexp.QuoteMeta(runtime.Version())+`",revision="[^"]+",version="[^"]+"\} 1\n`, fresh)
	require.Regexp(t, `target_info\{[^}]*service_name="idemreg"[^}]*service_version="[^"]+"`, fresh)
	require.NotContains(t, fresh, "otel_scope_")
	for _, series := range []string{
		`idemreg_extends_total`,
		`idemreg_completes_total`,
		`idemreg_overloaded_total{bound="server"}`,
		`idemreg_rate_limited_total{identity="anonymous"}`,
		`idemreg_auth_denied_total{code="UNAUTHENTICATED"}`,
		`idemreg_auth_denied_total{code="PERMISSION_DENIED"}`,
		`idemreg_bounds_refused_total{bound="pending_calls"}`,
		`idemreg_store_errors_total{error_type="unavailable",op="claim"}`,
		`idemreg_lease_lost_total{method="complete"}`,
		`idemreg_claims_total{outcome="in_progress"}`,
	} {
		require.Contains(t, fresh, series+" 0\n", "a fresh serve has %s at 0", series)
	}

	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	const claims = 25
	for i := range claims {
		_, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: fmt.Sprint(i)})
		require.NoError(t, err)
	}
	after := scrape(t, metricsAddr)
	// The buckets are cumulative: the count under 2.5 ms is that of
	// every bucket up to it. The call's first bound is 100 µs.
	re := regexp.MustCompile(`rpc_server_call_duration_seconds_bucket\{[^}]*rpc_method="idemreg.v1.RegistryService/Claim"[^}]*le="([0-9.e+-]+)"\} (\d+)\n`)
	buckets := map[string]int{}
	for _, m := range re.FindAllStringSubmatch(after, -1) {
		n, err := strconv.Atoi(m[2])
		require.NoError(t, err)
		buckets[m[1]] += n
	}
	require.Contains(t, buckets, "0.0001", "buckets from 100 µs; got %v", buckets)
	require.Contains(t, buckets, "0.00025")
	require.Positive(t, buckets["0.0025"], "Claims on a local store land under 2.5 ms (not all in the first 5 ms bucket); got %v", buckets)
}

// TestServePushesOTLPMetrics: with OTEL_METRICS_EXPORTER=otlp, serve
// pushes its metrics (and, with the endpoint set, its traces) to an OTLP
// HTTP receiver, here a handler that decodes the protobuf requests.
func TestServePushesOTLPMetrics(t *testing.T) {
	metricNames := make(chan string, 10000)
	traces := make(chan int, 100)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/metrics", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req colmetricspb.ExportMetricsServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		for _, rm := range req.GetResourceMetrics() {
			for _, sm := range rm.GetScopeMetrics() {
				for _, m := range sm.GetMetrics() {
					select {
					case metricNames <- m.GetName():
					default:
					}
				}
			}
		}
		out, _ := proto.Marshal(&colmetricspb.ExportMetricsServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	})
	mux.HandleFunc("POST /v1/traces", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		select {
		case traces <- len(req.GetResourceSpans()):
		default:
		}
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	receiver := &http.Server{Handler: mux}
	go func() { _ = receiver.Serve(lis) }()
	t.Cleanup(func() { _ = receiver.Close() })

	bin := servetest.Binary(t)
	p := servetest.Start(t, bin, t.TempDir(), []string{
		"OTEL_METRICS_EXPORTER=otlp",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + lis.Addr().String(),
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_METRIC_EXPORT_INTERVAL=200",
		"OTEL_BSP_SCHEDULE_DELAY=200",
	})
	p.WaitLog(t, "pushing metrics")
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	_, err = c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "otlp-1"})
	require.NoError(t, err)

	timeout := time.After(30 * time.Second) // a bound on a failure, not a measure
	want := map[string]bool{"idemreg.claims": false, "idemreg.build_info": false, "rpc.server.call.duration": false}
	for missing := len(want); missing > 0; {
		select {
		case name := <-metricNames:
			if seen, ok := want[name]; ok && !seen {
				want[name] = true
				missing--
			}
		case <-timeout:
			t.Fatalf("metrics not pushed: %v", want)
		}
	}
	select {
	case n := <-traces:
		require.Positive(t, n)
	case <-timeout:
		t.Fatal("traces not pushed")
	}
}

// TestServedBuildIsStamped: what make build stamps (-ldflags -X, into
// this package's variables) is what idemreg_build_info and the startup
// line name (versioncmd.Served).
func TestServedBuildIsStamped(t *testing.T) {
	saved := [3]string{version, revision, revisionTime}
	t.Cleanup(func() { version, revision, revisionTime = saved[0], saved[1], saved[2] })
	version, revision, revisionTime = "v1.4.0", "0123abcd", "2026-12-03T10:00:00Z"
	require.Equal(t, versioncmd.Stamp{Version: "v1.4.0", Revision: "0123abcd", Time: "2026-12-03T10:00:00Z"}, stamp())
	b := versioncmd.Served(stamp())
	require.Equal(t, "v1.4.0", b.Version)
	require.Equal(t, "0123abcd", b.Revision)
}
