package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
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

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
)

// isLoopback reports whether a listen address is reachable from this host
// only.
func isLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// surface is what serve runs beside the gRPC server.
type surface struct {
	access    *access.Source
	telemetry *telemetry
	closers   []func()
}

func (s *surface) close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
}

// startSurface takes the identities and rate limits of --config, sets up
// telemetry and the metrics listener, and checks that the server is not
// opened wider than asked for.
func startSurface(ctx context.Context, cfg *config, file *configfile.Source, logger *slog.Logger) (_ *surface, err error) {
	s := &surface{access: access.Static(access.Open())}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if file != nil {
		s.access = file.Access()
	}
	set := s.access.Current()
	switch {
	case set.Enforced():
		logger.Info("authentication on", "identities", set.Identities(), "mtls", cfg.TLS.ClientCAFile != "")
	case isLoopback(cfg.Listen):
		logger.Info("authentication off: no identities in --config; loopback only")
	case cfg.AllowUnauthenticated:
		logger.Warn("authentication off: every caller may use every consumer (--allow-unauthenticated)")
	default:
		return nil, fmt.Errorf("--listen %s is not a loopback address and --config names no identities, so every caller could use every consumer: add identities, or pass --allow-unauthenticated explicitly", cfg.Listen)
	}
	if set.HasTokens() && cfg.TLS.CertFile == "" && !isLoopback(cfg.Listen) {
		logger.Warn("bearer tokens travel in plaintext: serve TLS unless a mesh encrypts the traffic")
	}

	if s.telemetry, err = startTelemetry(ctx, logger); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, s.telemetry.shutdown)
	if cfg.MetricsListen != "" {
		stop, err := serveMetrics(cfg.MetricsListen, s.telemetry.registry, logger)
		if err != nil {
			return nil, err
		}
		s.closers = append(s.closers, stop)
	}
	return s, nil
}

// telemetry holds the metrics pipeline (OpenTelemetry instruments read by
// the Prometheus exporter into registry) and, when the OTEL_* environment
// asks for it, the OTLP trace exporter.
type telemetry struct {
	meters   *sdkmetric.MeterProvider
	registry *prometheus.Registry
	shutdown func()
}

// startTelemetry installs the meter provider globally too, so that every
// package's instruments (the sweeper's) reach /metrics.
func startTelemetry(ctx context.Context, logger *slog.Logger) (*telemetry, error) {
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "idemreg")),
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
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp), sdkmetric.WithResource(res))
	otel.SetMeterProvider(mp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	t := &telemetry{meters: mp, registry: reg}

	var tp *sdktrace.TracerProvider
	if protocol, ok := otlpTraces(); ok {
		var exporter sdktrace.SpanExporter
		if strings.HasPrefix(protocol, "http") {
			exporter, err = otlptracehttp.New(ctx)
		} else {
			exporter, err = otlptracegrpc.New(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("OTLP trace exporter: %w", err)
		}
		tp = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
		otel.SetTracerProvider(tp)
		logger.Info("exporting traces over OTLP", "protocol", protocol)
	}
	t.shutdown = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if tp != nil {
			if err := tp.Shutdown(ctx); err != nil {
				logger.Warn("trace exporter shutdown", "error", err)
			}
		}
		_ = mp.Shutdown(ctx)
	}
	return t, nil
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

// serveMetrics serves the registry on http://addr/metrics until the
// returned function is called.
func serveMetrics(addr string, reg *prometheus.Registry, logger *slog.Logger) (stop func(), err error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listening on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("metrics listener failed", "error", err)
		}
	}()
	logger.Info("serving metrics", "listen", lis.Addr().String())
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

// serveHealth serves the health service alone on --health-listen.
func serveHealth(srv *server.Server, addr string, logger *slog.Logger) error {
	if addr == "" {
		return nil
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("health: listening on %s: %w", addr, err)
	}
	logger.Info("serving health", "listen", lis.Addr().String())
	go func() {
		if err := srv.ServeHealth(lis); err != nil {
			logger.Error("health listener failed", "error", err)
		}
	}()
	return nil
}
