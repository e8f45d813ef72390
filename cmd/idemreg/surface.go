package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
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

// surfaceConfig is the production surface of serve: transport security,
// who may call, overload limits, telemetry and the listeners beside the
// gRPC one.
type surfaceConfig struct {
	TLSCert, TLSKey, TLSClientCA string
	// Plaintext allows serving without TLS on an address that is not
	// loopback; AllowUnauthenticated allows serving there without
	// identities.
	Plaintext, AllowUnauthenticated bool
	MetricsListen, HealthListen     string
	RequestTimeout                  time.Duration
	MaxRequestTimeout               time.Duration
	MaxInFlight                     int
	MaxInFlightPerIdentity          int
	MaxWaiters                      int
	WaitRecheck                     time.Duration
	QuotaRefresh                    time.Duration
	ParkedCountInterval             time.Duration // 0: no parked records gauge
	StreamWorkers                   int
	MaxConnectionAge                time.Duration
	MaxConnectionIdle               time.Duration
	DrainDelay, ShutdownTimeout     time.Duration
	DisableReflection               bool
	// Bounds limit what any peer that connects may make serve hold, on
	// the gRPC and the health listener.
	Bounds server.Bounds
	// Readiness decides when failing store calls make serve unready.
	Readiness server.Readiness
}

func defaultSurface() surfaceConfig {
	ka := server.DefaultKeepalive()
	return surfaceConfig{
		RequestTimeout:      server.DefaultRequestTimeout,
		MaxRequestTimeout:   server.DefaultMaxRequestTimeout,
		MaxInFlight:         server.DefaultMaxInFlight,
		MaxWaiters:          server.DefaultMaxWaiters,
		WaitRecheck:         server.DefaultWaitRecheck,
		QuotaRefresh:        server.DefaultQuotaRefresh,
		ParkedCountInterval: server.DefaultParkedCountInterval,
		StreamWorkers:       server.DefaultStreamWorkers,
		MaxConnectionAge:    ka.MaxConnectionAge,
		MaxConnectionIdle:   ka.MaxConnectionIdle,
		ShutdownTimeout:     10 * time.Second,
		Bounds:              server.DefaultBounds(),
		Readiness: server.Readiness{
			Window:          server.DefaultReadinessWindow,
			MinCalls:        server.DefaultReadinessMinCalls,
			MaxFailureRatio: server.DefaultReadinessMaxFailureRatio,
		},
	}
}

func (s *surfaceConfig) bind(fs *flag.FlagSet) {
	fs.StringVar(&s.TLSCert, "tls-cert", s.TLSCert, "PEM certificate chain of the server; with --tls-key, serve TLS (files are re-read when they change)")
	fs.StringVar(&s.TLSKey, "tls-key", s.TLSKey, "PEM private key of --tls-cert")
	fs.StringVar(&s.TLSClientCA, "tls-client-ca", s.TLSClientCA, "PEM CAs of client certificates: every client must present one they sign (mTLS); identities match its URI SAN, DNS SAN or subject")
	fs.BoolVar(&s.Plaintext, "plaintext", s.Plaintext, "serve without TLS on an address that is not loopback (behind a mesh that encrypts)")
	fs.BoolVar(&s.AllowUnauthenticated, "allow-unauthenticated", s.AllowUnauthenticated, "serve an address that is not loopback without identities in --config: every caller may use every consumer")
	fs.StringVar(&s.MetricsListen, "metrics-listen", s.MetricsListen, "serve Prometheus metrics on http://ADDR/metrics (off when empty)")
	fs.StringVar(&s.HealthListen, "health-listen", s.HealthListen, "serve grpc.health.v1 alone, in plaintext, on this address, for Kubernetes gRPC probes (off when empty)")
	fs.DurationVar(&s.RequestTimeout, "request-timeout", s.RequestTimeout, "budget of a request that carries no deadline")
	fs.DurationVar(&s.MaxRequestTimeout, "max-request-timeout", s.MaxRequestTimeout, "longest deadline a request may carry; longer ones are cut to it")
	fs.IntVar(&s.MaxInFlight, "max-in-flight", s.MaxInFlight, "most store operations at once; beyond it calls fail at once with UNAVAILABLE (OVERLOADED)")
	fs.IntVar(&s.MaxInFlightPerIdentity, "max-in-flight-per-identity", s.MaxInFlightPerIdentity, "most store operations at once of one identity of --config, so one tenant cannot take every slot (0: half of --max-in-flight; --max-in-flight turns it off)")
	fs.IntVar(&s.MaxWaiters, "max-waiters", s.MaxWaiters, "most Claims waiting at once for a key in progress (ClaimRequest.wait); beyond it a Claim answers at once")
	fs.DurationVar(&s.WaitRecheck, "wait-recheck", s.WaitRecheck, "how often a waiting Claim looks for changes made through other replicas: how late it may wake for them")
	fs.DurationVar(&s.QuotaRefresh, "quota-refresh", s.QuotaRefresh, "how often the live records and bytes of the consumers with a quota (max_records, max_bytes in --config) are counted in the store: how late a replica learns of other replicas' new keys")
	fs.DurationVar(&s.ParkedCountInterval, "parked-count-interval", s.ParkedCountInterval, "how often the parked records of every consumer are counted in the store (from its index of parked records) for the idemreg_parked_records gauge; 0 turns the gauge off")
	fs.IntVar(&s.StreamWorkers, "stream-workers", s.StreamWorkers, "goroutines kept to run calls, reusing their stacks (0: a new goroutine per call)")
	fs.DurationVar(&s.MaxConnectionAge, "max-connection-age", s.MaxConnectionAge, "close client connections after about this long (clients reconnect, so load spreads over new replicas)")
	fs.DurationVar(&s.MaxConnectionIdle, "max-connection-idle", s.MaxConnectionIdle, "close client connections that have had no call for this long")
	b := &s.Bounds
	fs.Func("max-header-list-size", fmt.Sprintf("largest header list of one call, in bytes (names, values and 32 bytes per field); a call over it is refused before any handler (default %d)", b.MaxHeaderListSize), func(v string) error {
		n, err := strconv.ParseUint(v, 10, 32)
		b.MaxHeaderListSize = uint32(n)
		return err
	})
	fs.Func("max-concurrent-streams", fmt.Sprintf("most calls open at once on one connection; clients queue beyond it (default %d)", b.MaxConcurrentStreams), func(v string) error {
		n, err := strconv.ParseUint(v, 10, 32)
		b.MaxConcurrentStreams = uint32(n)
		return err
	})
	fs.IntVar(&b.MaxConnections, "max-connections", b.MaxConnections, "most connections each listener (gRPC, health) holds open; beyond it new ones wait to be accepted")
	fs.IntVar(&b.MaxPublicStreams, "max-public-streams", b.MaxPublicStreams, "most health Watch and reflection streams (which need no credentials) open at once; beyond it they fail with RESOURCE_EXHAUSTED")
	fs.IntVar(&b.MaxCallsPerIdentity, "max-calls-per-identity", b.MaxCallsPerIdentity, "most calls one identity of --config has in progress at once; beyond it they fail with RESOURCE_EXHAUSTED (TOO_MANY_CALLS)")
	fs.DurationVar(&b.ConnectionTimeout, "connection-timeout", b.ConnectionTimeout, "longest a new connection may take over its TLS and HTTP/2 handshakes")
	r := &s.Readiness
	fs.IntVar(&r.Window, "readiness-window", r.Window, "health intervals (2 s each) over which the store calls' failure rate decides readiness")
	fs.IntVar(&r.MinCalls, "readiness-min-calls", r.MinCalls, "fewest store calls in the readiness window for their failure rate to count")
	fs.Float64Var(&r.MaxFailureRatio, "readiness-max-failure-ratio", r.MaxFailureRatio, "share of failed store calls in the readiness window, in (0, 1], at which serve reports NOT_SERVING")
	fs.DurationVar(&s.DrainDelay, "drain-delay", s.DrainDelay, "on SIGTERM, keep serving this long after health turns NOT_SERVING, for load balancers to notice")
	fs.DurationVar(&s.ShutdownTimeout, "shutdown-timeout", s.ShutdownTimeout, "on SIGTERM, longest wait for calls in flight before connections are cut")
	fs.BoolVar(&s.DisableReflection, "disable-reflection", s.DisableReflection, "turn gRPC server reflection off")
}

// validate reports surface settings that cannot work for the listen
// address.
func (s *surfaceConfig) validate(listen string) []error {
	var errs []error
	if (s.TLSCert == "") != (s.TLSKey == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key go together"))
	}
	if s.TLSClientCA != "" && s.TLSCert == "" {
		errs = append(errs, errors.New("--tls-client-ca needs --tls-cert and --tls-key"))
	}
	if s.Plaintext && s.TLSCert != "" {
		errs = append(errs, errors.New("--plaintext contradicts --tls-cert"))
	}
	if s.TLSCert == "" && !s.Plaintext && listen != "" && !isLoopback(listen) {
		errs = append(errs, fmt.Errorf("--listen %s is not a loopback address: serve TLS (--tls-cert, --tls-key) or pass --plaintext explicitly", listen))
	}
	if s.RequestTimeout <= 0 || s.MaxRequestTimeout < s.RequestTimeout {
		errs = append(errs, fmt.Errorf("need 0 < --request-timeout (%v) <= --max-request-timeout (%v)", s.RequestTimeout, s.MaxRequestTimeout))
	}
	if s.MaxInFlight < 1 {
		errs = append(errs, fmt.Errorf("--max-in-flight must be positive, got %d", s.MaxInFlight))
	}
	if s.MaxInFlightPerIdentity < 0 || s.MaxInFlightPerIdentity > s.MaxInFlight {
		errs = append(errs, fmt.Errorf("--max-in-flight-per-identity must be between 0 (half of --max-in-flight) and --max-in-flight (%d), got %d", s.MaxInFlight, s.MaxInFlightPerIdentity))
	}
	if s.MaxWaiters < 1 {
		errs = append(errs, fmt.Errorf("--max-waiters must be positive, got %d", s.MaxWaiters))
	}
	if s.WaitRecheck < time.Millisecond || s.WaitRecheck > server.MaxWait {
		errs = append(errs, fmt.Errorf("--wait-recheck must be between 1ms and %v, got %v", server.MaxWait, s.WaitRecheck))
	}
	if s.QuotaRefresh < time.Second {
		errs = append(errs, fmt.Errorf("--quota-refresh must be at least 1s (each refresh counts every record of the consumers with a quota), got %v", s.QuotaRefresh))
	}
	if s.ParkedCountInterval != 0 && s.ParkedCountInterval < time.Second {
		errs = append(errs, fmt.Errorf("--parked-count-interval must be at least 1s, or 0 to turn the parked records gauge off, got %v", s.ParkedCountInterval))
	}
	if s.StreamWorkers < 0 {
		errs = append(errs, fmt.Errorf("--stream-workers must not be negative, got %d", s.StreamWorkers))
	}
	if s.MaxConnectionAge <= 0 || s.MaxConnectionIdle <= 0 {
		errs = append(errs, fmt.Errorf("--max-connection-age and --max-connection-idle must be positive, got %v and %v", s.MaxConnectionAge, s.MaxConnectionIdle))
	}
	// Zero would take the server's default; on the command line it is
	// more likely a mistake for "no bound", which there is not.
	b := s.Bounds
	if b.MaxHeaderListSize == 0 || b.MaxConcurrentStreams == 0 || b.MaxConnections <= 0 || b.MaxPublicStreams <= 0 || b.MaxCallsPerIdentity <= 0 || b.ConnectionTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--max-header-list-size (%d), --max-concurrent-streams (%d), --max-connections (%d), --max-public-streams (%d), --max-calls-per-identity (%d) and --connection-timeout (%v) must be positive",
			b.MaxHeaderListSize, b.MaxConcurrentStreams, b.MaxConnections, b.MaxPublicStreams, b.MaxCallsPerIdentity, b.ConnectionTimeout))
	} else if err := b.Validate(); err != nil {
		errs = append(errs, err)
	}
	if r := s.Readiness; r.Window <= 0 || r.MinCalls <= 0 || r.MaxFailureRatio <= 0 {
		errs = append(errs, fmt.Errorf("--readiness-window (%d), --readiness-min-calls (%d) and --readiness-max-failure-ratio (%v) must be positive", r.Window, r.MinCalls, r.MaxFailureRatio))
	} else if err := r.Validate(); err != nil {
		errs = append(errs, err)
	}
	if s.DrainDelay < 0 || s.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--drain-delay must not be negative and --shutdown-timeout must be positive, got %v and %v", s.DrainDelay, s.ShutdownTimeout))
	}
	return errs
}

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
	sc := &cfg.Surface
	switch {
	case set.Enforced():
		logger.Info("authentication on", "identities", set.Identities(), "mtls", sc.TLSClientCA != "")
	case isLoopback(cfg.Listen):
		logger.Info("authentication off: no identities in --config; loopback only")
	case sc.AllowUnauthenticated:
		logger.Warn("authentication off: every caller may use every consumer (--allow-unauthenticated)")
	default:
		return nil, fmt.Errorf("--listen %s is not a loopback address and --config names no identities, so every caller could use every consumer: add identities, or pass --allow-unauthenticated explicitly", cfg.Listen)
	}
	if set.HasTokens() && sc.TLSCert == "" && !isLoopback(cfg.Listen) {
		logger.Warn("bearer tokens travel in plaintext: serve TLS unless a mesh encrypts the traffic")
	}

	if s.telemetry, err = startTelemetry(ctx, logger); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, s.telemetry.shutdown)
	if sc.MetricsListen != "" {
		stop, err := serveMetrics(sc.MetricsListen, s.telemetry.registry, logger)
		if err != nil {
			return nil, err
		}
		s.closers = append(s.closers, stop)
	}
	return s, nil
}

// serverConfig is the server's configuration from the flags and the
// surface.
func (s *surface) serverConfig(cfg *config, logger *slog.Logger) (server.Config, error) {
	sc := &cfg.Surface
	out := server.Config{
		Limits:                 cfg.Limits,
		Logger:                 logger,
		Access:                 s.access,
		RequestTimeout:         sc.RequestTimeout,
		MaxRequestTimeout:      sc.MaxRequestTimeout,
		MaxInFlight:            sc.MaxInFlight,
		MaxInFlightPerIdentity: sc.MaxInFlightPerIdentity,
		MaxWaiters:             sc.MaxWaiters,
		WaitRecheck:            sc.WaitRecheck,
		QuotaRefresh:           sc.QuotaRefresh,
		ParkedCountInterval:    cmp.Or(sc.ParkedCountInterval, -1),
		StreamWorkers:          cmp.Or(sc.StreamWorkers, -1),
		DrainDelay:             sc.DrainDelay,
		ShutdownTimeout:        sc.ShutdownTimeout,
		DisableReflection:      sc.DisableReflection,
		Bounds:                 sc.Bounds,
		Readiness:              sc.Readiness,
		MeterProvider:          s.telemetry.meters,
		TracerProvider:         otel.GetTracerProvider(),
	}
	out.Keepalive = server.DefaultKeepalive()
	out.Keepalive.MaxConnectionAge = sc.MaxConnectionAge
	out.Keepalive.MaxConnectionIdle = sc.MaxConnectionIdle
	if sc.TLSCert != "" {
		tlsCfg, err := server.TLSConfig(server.TLSFiles{CertFile: sc.TLSCert, KeyFile: sc.TLSKey, ClientCAFile: sc.TLSClientCA}, logger)
		if err != nil {
			return server.Config{}, err
		}
		out.TLS = tlsCfg
	}
	return out, nil
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
