package telemetry

import (
	"log/slog"
	"net/http/httptest"
	"runtime"
	"testing"

	"go.opentelemetry.io/otel/metric"

	"github.com/stretchr/testify/require"
)

var otelVars = []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
	"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"}

// TestSpanExporterFromEnv: the span exporter follows the standard OTEL_*
// variables (through autoexport) and is off when they ask for none.
func TestSpanExporterFromEnv(t *testing.T) {
	cases := []struct {
		name    string
		env     map[string]string
		on      bool
		invalid bool
	}{
		{"nothing set", nil, false, false},
		{"endpoint alone: OTLP", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, true, false},
		{"traces endpoint, grpc", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, true, false},
		{"otlp by name", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true, false},
		{"console", map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true, false},
		{"exporter none", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_TRACES_EXPORTER": "none"}, false, false},
		{"sdk disabled", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_SDK_DISABLED": "true"}, false, false},
		{"unknown exporter", map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, false, true},
		{"unknown protocol", map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range otelVars {
				t.Setenv(v, tc.env[v])
			}
			e, err := spanExporter(t.Context())
			if tc.invalid {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.on, e != nil)
			if e != nil {
				require.NoError(t, e.Shutdown(t.Context()))
			}
		})
	}
}

// TestMetricsPushFromEnv: a pushing reader is added only when
// OTEL_METRICS_EXPORTER names one; unset keeps /metrics alone.
func TestMetricsPushFromEnv(t *testing.T) {
	cases := []struct {
		name    string
		env     map[string]string
		on      bool
		invalid bool
	}{
		{"nothing set", nil, false, false},
		{"endpoint alone: no push", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, false, false},
		{"otlp", map[string]string{"OTEL_METRICS_EXPORTER": "otlp"}, true, false},
		{"otlp over grpc", map[string]string{"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, true, false},
		{"console", map[string]string{"OTEL_METRICS_EXPORTER": "console"}, true, false},
		{"none", map[string]string{"OTEL_METRICS_EXPORTER": "none"}, false, false},
		{"prometheus is /metrics", map[string]string{"OTEL_METRICS_EXPORTER": "prometheus"}, false, false},
		{"sdk disabled", map[string]string{"OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, false, false},
		{"unknown exporter", map[string]string{"OTEL_METRICS_EXPORTER": "statsd"}, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range otelVars {
				t.Setenv(v, tc.env[v])
			}
			r, err := metricsPush(t.Context())
			if tc.invalid {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.on, r != nil)
			if r != nil {
				require.NoError(t, r.Shutdown(t.Context()))
			}
		})
	}
}

// TestPrometheusExposition: what /metrics shows of the pipeline: latency
// buckets from 100 µs on otelgrpc's histogram, idemreg_build_info,
// service.version on target_info, and no otel_scope_* labels.
func TestPrometheusExposition(t *testing.T) {
	for _, v := range otelVars {
		t.Setenv(v, "")
	}
	p, err := Start(t.Context(), "idemreg-test", Build{Version: "v1.2.3", Revision: "abc123", GoVersion: "go1.26.8"}, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(p.Shutdown)
	h, err := p.Meters.Meter("go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc").
		Float64Histogram("rpc.server.call.duration", metric.WithUnit("s"),
			metric.WithExplicitBucketBoundaries(0.005, 0.01)) // otelgrpc's hint, which the view overrides
	require.NoError(t, err)
	for _, d := range []float64{0.00015, 0.0003, 0.0003, 0.002, 0.2} {
		h.Record(t.Context(), d)
	}

	rec := httptest.NewRecorder()
	p.Metrics().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	for _, want := range []string{
		"rpc_server_call_duration_seconds_bucket{le=\"0.0001\"} 0\n",
		"rpc_server_call_duration_seconds_bucket{le=\"0.00025\"} 1\n",
		"rpc_server_call_duration_seconds_bucket{le=\"0.0005\"} 3\n",
		"rpc_server_call_duration_seconds_bucket{le=\"0.0025\"} 4\n",
		"rpc_server_call_duration_seconds_count 5\n",
		"idemreg_build_info{goversion=\"go1.26.8\",revision=\"abc123\",version=\"v1.2.3\"} 1\n",
	} {
		require.Contains(t, body, want)
	}
	require.Regexp(t, `target_info\{[^}]*service_name="idemreg-test"[^}]*service_version="v1.2.3"`, body)
	require.NotContains(t, body, "otel_scope_")
}

// TestReadBuild: the binary's own build information, never empty.
func TestReadBuild(t *testing.T) {
	b := ReadBuild()
	require.Equal(t, runtime.Version(), b.GoVersion)
	require.NotEmpty(t, b.Version)
	require.NotEmpty(t, b.Revision)
}
