// Package telemetry is the process's OpenTelemetry pipeline, which the
// commands set up once: metrics read into a Prometheus registry for
// /metrics, traces exported over OTLP when the standard OTEL_* variables ask
// for them, and the handler of the slog lines (logs.go). The libraries only
// take providers and loggers; none of them imports this.
package telemetry

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Pipeline holds the providers of a process.
type Pipeline struct {
	// Meters make the instruments of every package, read by the
	// Prometheus exporter into the registry that Metrics serves.
	Meters *sdkmetric.MeterProvider
	// Tracers is the OTLP exporter's provider when the environment asks
	// for traces, else the global one (which only carries the caller's
	// trace context).
	Tracers trace.TracerProvider

	registry *prometheus.Registry
	exporter *sdktrace.TracerProvider // nil without OTLP
	logger   *slog.Logger
}

// Start sets the pipeline up and installs it as the global providers and
// propagator too, so that the instruments of packages given no provider
// (the sweeper's) reach /metrics and every call joins its caller's trace
// (W3C traceparent).
func Start(ctx context.Context, service string, logger *slog.Logger) (*Pipeline, error) {
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
		resource.WithTelemetrySDK())
	if err != nil {
		return nil, fmt.Errorf("telemetry resource: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	p := &Pipeline{
		Meters:   sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp), sdkmetric.WithResource(res)),
		registry: reg,
		logger:   logger,
	}
	otel.SetMeterProvider(p.Meters)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	if protocol, ok := otlpTraces(); ok {
		var exporter sdktrace.SpanExporter
		if strings.HasPrefix(protocol, "http") {
			exporter, err = otlptracehttp.New(ctx)
		} else {
			exporter, err = otlptracegrpc.New(ctx)
		}
		if err != nil {
			_ = p.Meters.Shutdown(ctx)
			return nil, fmt.Errorf("OTLP trace exporter: %w", err)
		}
		p.exporter = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
		otel.SetTracerProvider(p.exporter)
		logger.Info("exporting traces over OTLP", "protocol", protocol)
	}
	p.Tracers = otel.GetTracerProvider()
	return p, nil
}

// Metrics serves the registry in the Prometheus exposition format: the
// meters' instruments, Go's and the process's.
func (p *Pipeline) Metrics() http.Handler {
	return promhttp.HandlerFor(p.registry, promhttp.HandlerOpts{Registry: p.registry})
}

// Shutdown flushes the spans not yet exported and stops the providers.
func (p *Pipeline) Shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if p.exporter != nil {
		if err := p.exporter.Shutdown(ctx); err != nil {
			p.logger.Warn("trace exporter shutdown", "error", err)
		}
	}
	_ = p.Meters.Shutdown(ctx)
}

// otlpTraces reports whether the standard OTEL_* variables ask for an OTLP
// trace exporter, and over which protocol (the specification's default is
// http/protobuf).
func otlpTraces() (protocol string, ok bool) {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return "", false
	}
	switch e := os.Getenv("OTEL_TRACES_EXPORTER"); e {
	case "", "otlp":
	default: // "none", or an exporter this binary does not have
		return "", false
	}
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return "", false
	}
	protocol = os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if protocol == "" {
		protocol = "http/protobuf"
	}
	return protocol, true
}
