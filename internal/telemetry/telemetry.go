// Package telemetry is the process's OpenTelemetry pipeline, which the
// commands set up once: metrics read into a Prometheus registry for
// /metrics (and pushed too when OTEL_METRICS_EXPORTER asks for it), traces
// exported when the standard OTEL_* variables ask for them, the build's
// identity (idemreg_build_info, service.version), and the handler of the
// slog lines (logs.go). The libraries only take providers and loggers; none
// of them imports this.
package telemetry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Build is what a binary says of itself: idemreg_build_info's labels,
// the resource's service.version and the startup log line.
type Build struct {
	Version   string // the module version, "(devel)" in a checkout
	Revision  string // the VCS revision, "unknown" when the build had none
	GoVersion string
}

// ReadBuild is the running binary's Build, as the Go toolchain recorded it
// (debug.ReadBuildInfo). A build with -buildvcs=false, or outside a
// checkout, has no revision: "unknown"; a build of a modified tree has
// "+modified" after it.
func ReadBuild() Build {
	b := Build{Version: "unknown", Revision: "unknown", GoVersion: "unknown"}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.Version, b.GoVersion = info.Main.Version, info.GoVersion
	modified := false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if modified && b.Revision != "unknown" {
		b.Revision += "+modified"
	}
	return b
}

// MetricBuildInfo is the build's gauge, always 1, labelled with the Build
// (version, revision, goversion): idemreg_build_info on /metrics.
const MetricBuildInfo = "idemreg.build_info"

// LatencyBuckets are the bucket boundaries (seconds) of the latency
// histograms that have no better ones of their own: from 100 µs, where a
// Claim on a local store lands, to 10 s. The SDK's and otelgrpc's defaults
// start at 5 ms, under which every call of a healthy server falls, so
// that no quantile could be read.
var LatencyBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// latencyViews give the instruments of libraries whose bucket boundaries
// cannot be chosen at the call site (otelgrpc's rpc.server.call.duration,
// in seconds) LatencyBuckets. (The old semantic conventions' duration,
// which OTEL_SEMCONV_STABILITY_OPT_IN can bring back, is in milliseconds:
// these boundaries would be wrong for it, and it keeps its own.)
func latencyViews() []sdkmetric.View {
	return []sdkmetric.View{sdkmetric.NewView(sdkmetric.Instrument{Name: "rpc.server.call.duration", Unit: "s"},
		sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: LatencyBuckets}})}
}

// Pipeline holds the providers of a process.
type Pipeline struct {
	// Meters make the instruments of every package, read by the
	// Prometheus exporter into the registry that Metrics serves (and by
	// the push reader OTEL_METRICS_EXPORTER chose, if any).
	Meters *sdkmetric.MeterProvider
	// Tracers is the exporter's provider when the environment asks for
	// traces, else the global one (which only carries the caller's trace
	// context).
	Tracers trace.TracerProvider

	registry *prometheus.Registry
	exporter *sdktrace.TracerProvider // nil without a span exporter
	logger   *slog.Logger
}

// Start sets the pipeline up and installs it as the global providers and
// propagator too, so that the instruments of packages given no provider
// (the sweeper's) reach /metrics and every call joins its caller's trace
// (W3C traceparent).
//
// Exporters are autoexport's, chosen by the standard variables:
// OTEL_METRICS_EXPORTER (otlp, console, none; unset: none, /metrics
// only) adds a pushing reader beside /metrics; OTEL_TRACES_EXPORTER (otlp,
// console, none) chooses the span exporter, and when it is unset, traces
// go over OTLP if an OTLP endpoint is set, nowhere otherwise.
// OTEL_SDK_DISABLED=true turns both off.
func Start(ctx context.Context, service string, build Build, logger *slog.Logger) (*Pipeline, error) {
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service), attribute.String("service.version", build.Version)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
		resource.WithTelemetrySDK())
	if err != nil {
		return nil, fmt.Errorf("telemetry resource: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// Without the otel_scope_* labels: each instrument has one scope, and
	// the labels only lengthened every series.
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithoutScopeInfo())
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	opts := []sdkmetric.Option{sdkmetric.WithReader(exp), sdkmetric.WithResource(res), sdkmetric.WithView(latencyViews()...)}
	push, err := metricsPush(ctx)
	if err != nil {
		return nil, err
	}
	if push != nil {
		opts = append(opts, sdkmetric.WithReader(push))
		logger.Info("pushing metrics", "exporter", os.Getenv("OTEL_METRICS_EXPORTER"))
	}
	p := &Pipeline{
		Meters:   sdkmetric.NewMeterProvider(opts...),
		registry: reg,
		logger:   logger,
	}
	if err := buildInfo(p.Meters, build); err != nil {
		_ = p.Meters.Shutdown(ctx)
		return nil, err
	}
	otel.SetMeterProvider(p.Meters)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	spans, err := spanExporter(ctx)
	if err != nil {
		_ = p.Meters.Shutdown(ctx)
		return nil, err
	}
	if spans != nil {
		p.exporter = sdktrace.NewTracerProvider(sdktrace.WithBatcher(spans), sdktrace.WithResource(res))
		otel.SetTracerProvider(p.exporter)
		logger.Info("exporting traces", "exporter", cmp.Or(os.Getenv("OTEL_TRACES_EXPORTER"), "otlp"))
	}
	p.Tracers = otel.GetTracerProvider()
	return p, nil
}

// buildInfo registers idemreg.build_info.
func buildInfo(mp metric.MeterProvider, b Build) error {
	m := mp.Meter("github.com/idemreg/idemreg")
	g, err := m.Int64ObservableGauge(MetricBuildInfo,
		metric.WithDescription("Always 1, labelled with the binary's version, VCS revision and Go version."))
	if err != nil {
		return fmt.Errorf("telemetry: build info: %w", err)
	}
	set := metric.WithAttributeSet(attribute.NewSet(attribute.String("version", b.Version),
		attribute.String("revision", b.Revision), attribute.String("goversion", b.GoVersion)))
	_, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(g, 1, set)
		return nil
	}, g)
	if err != nil {
		return fmt.Errorf("telemetry: build info: %w", err)
	}
	return nil
}

func sdkDisabled() bool { return strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") }

// metricsPush is the pushing reader that OTEL_METRICS_EXPORTER asks for,
// nil for none. Unset means none here (not autoexport's otlp): /metrics is
// the default, and a push only happens when asked for. "prometheus" is
// what --metrics-listen serves already, so it adds nothing either (rather
// than a second listener on autoexport's port).
func metricsPush(ctx context.Context) (sdkmetric.Reader, error) {
	switch os.Getenv("OTEL_METRICS_EXPORTER") {
	case "", "none", "prometheus":
		return nil, nil
	}
	if sdkDisabled() {
		return nil, nil
	}
	r, err := autoexport.NewMetricReader(ctx)
	if err != nil {
		return nil, fmt.Errorf("OTEL_METRICS_EXPORTER=%s: %w", os.Getenv("OTEL_METRICS_EXPORTER"), err)
	}
	return r, nil
}

// spanExporter is the span exporter that the standard variables ask for,
// nil for none: OTEL_TRACES_EXPORTER's, or OTLP when only an OTLP endpoint
// is set (the behaviour before autoexport, kept so that setting the
// endpoint alone still exports).
func spanExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	if sdkDisabled() {
		return nil, nil
	}
	if os.Getenv("OTEL_TRACES_EXPORTER") == "" &&
		os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return nil, nil
	}
	e, err := autoexport.NewSpanExporter(ctx)
	if err != nil {
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%s: %w", os.Getenv("OTEL_TRACES_EXPORTER"), err)
	}
	if autoexport.IsNoneSpanExporter(e) {
		return nil, nil
	}
	return e, nil
}

// Metrics serves the registry in the Prometheus exposition format: the
// meters' instruments, Go's and the process's.
func (p *Pipeline) Metrics() http.Handler {
	return promhttp.HandlerFor(p.registry, promhttp.HandlerOpts{Registry: p.registry})
}

// Shutdown flushes the spans and metrics not yet exported and stops the
// providers.
func (p *Pipeline) Shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var errs []error
	if p.exporter != nil {
		errs = append(errs, p.exporter.Shutdown(ctx))
	}
	errs = append(errs, p.Meters.Shutdown(ctx))
	if err := errors.Join(errs...); err != nil {
		p.logger.Warn("telemetry shutdown", "error", err)
	}
}
