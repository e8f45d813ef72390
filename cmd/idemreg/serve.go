package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/profiling"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sharedport"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/versioncmd"
	"github.com/idemreg/idemreg/internal/telemetry"
	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// serveCommand binds the flags of serve, the gRPC service.
func serveCommand(fs *flag.FlagSet) command.Run {
	cfg := config.Default()
	cfg.BindServe(fs)
	return func(ctx context.Context, _, stderr io.Writer) error { return serve(ctx, &cfg, stderr) }
}

func serve(ctx context.Context, cfg *config.Config, stderr io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	logger := cfg.Logger(stderr)
	tuneGC(logger)
	stopPprof, err := profiling.Serve(cfg.PprofListen, os.Args, cfg.HTTP, logger)
	if err != nil {
		return err
	}
	defer stopPprof()
	file, err := configfile.Open(cfg.PolicyFile, cfg.Server.Limits.Policy())
	if err != nil {
		return err
	}
	if cfg.PolicyFile != "" {
		c := file.Current()
		logger.Info("config loaded", "path", cfg.PolicyFile, "version", c.Version, "consumer_policies", c.Policy.Len(), "identities", c.Access.Identities())
	}
	// Reloads go on while serve drains, until it returns.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	watchCtx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWatch()
	go file.Watch(watchCtx, cfg.ConfigPoll, hup, logger)
	if err := checkAccess(cfg, file.Current().Access, logger); err != nil {
		return err
	}
	types, err := resulttype.Load(cfg.DescriptorSet)
	if err != nil {
		return fmt.Errorf("--descriptor-set: %w", err)
	}
	build := versioncmd.Served(stamp())
	logger.Info("starting idemreg", "version", build.Version, "revision", build.Revision, "go_version", build.GoVersion,
		"store", cfg.StoreKind())
	tel, err := telemetry.Start(ctx, "idemreg", build, logger)
	if err != nil {
		return err
	}
	defer tel.Shutdown()
	if err := file.Observe(tel.Meters); err != nil {
		return err
	}
	// The metrics listener's mux: /metrics now, /healthz and /readyz once
	// the server exists (below).
	metricsMux := http.NewServeMux()
	if cfg.MetricsListen != "" {
		metricsMux.Handle("GET /metrics", tel.Metrics())
		stop, addr, err := httpserve.Serve("metrics", cfg.MetricsListen, metricsMux, cfg.HTTP, logger)
		if err != nil {
			return err
		}
		defer stop()
		logger.Info("serving metrics", "listen", addr.String())
	}

	store, err := cfg.OpenStore(ctx, logger, tel.Meters)
	if err != nil {
		return err
	}
	defer store.Close()

	srvCfg := cfg.Server
	srvCfg.Logger, srvCfg.File, srvCfg.ResultTypes = logger, file, types
	srvCfg.MeterProvider, srvCfg.TracerProvider = tel.Meters, tel.Tracers
	if cfg.TLS.CertFile != "" {
		if srvCfg.TLS, err = server.TLSConfig(cfg.TLS, logger); err != nil {
			return err
		}
	}
	srv, err := server.New(store, srvCfg)
	if err != nil {
		return err
	}
	if err := serveHealth(srv, cfg.HealthListen, logger); err != nil {
		return err
	}
	if cfg.MetricsListen != "" {
		// GET /healthz and /readyz for probes that do not speak gRPC
		// health, answered by the gRPC health service itself.
		conn, err := srv.InProcess()
		if err != nil {
			return err
		}
		defer conn.Close()
		httpserve.HealthChecks{Client: healthpb.NewHealthClient(conn), Liveness: server.LivenessService}.Register(metricsMux)
	}
	stopSweeper, err := startSweeper(ctx, cfg, store, logger)
	if err != nil {
		return err
	}
	defer stopSweeper() // before the store closes
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", cfg.Listen, err)
	}
	stopConsole, err := startConsole(ctx, cfg, func() *access.Set { return file.Current().Access }, types, srv, store, logger)
	if err != nil {
		_ = lis.Close()
		return err
	}
	defer stopConsole()
	grpcLis := lis
	if !cfg.DisableHTTPAPI {
		var httpLis net.Listener
		grpcLis, httpLis = sharedport.Split(lis, srvCfg.TLS, cfg.Server.Bounds.ConnectionTimeout, logger,
			sharedport.WithMaxSniffingPerSource(cfg.MaxConnectingPerSource))
		origins, _ := sharedport.CORSOrigins(cfg.HTTPAPICORSOrigins) // checked by Validate
		stopAPI, err := sharedport.ServeAPI(srv.GRPCServer(), srv, srv.MaxRequestBytes(), httpLis, srvCfg.TLS, origins, cfg.HTTP, logger)
		if err != nil {
			_ = lis.Close()
			return err
		}
		defer stopAPI()
	}
	logger.Info("serving", "listen", lis.Addr().String(), "http_api", !cfg.DisableHTTPAPI)
	if err := srv.Serve(ctx, grpcLis); err != nil {
		if errors.Is(err, server.ErrStoreFailed) {
			// Exit for the supervisor to restart serve: a new process
			// recovers the store from what it synced. The deferred stops
			// run first, but none may keep the process from exiting (a
			// write of the sweeper's may be stuck in the failed store).
			time.AfterFunc(storeFailedExitTimeout, func() {
				fmt.Fprintln(stderr, "idemreg:", err, "(cleanup did not finish; exiting)")
				os.Exit(config.ExitStoreFailed)
			})
			return command.Exit(config.ExitStoreFailed, err)
		}
		return err
	}
	logger.Info("stopped")
	return nil
}

// checkAccess checks that who may call (set: the identities and rate
// limits of --config; everyone when there is none) does not open serve
// wider than asked for.
func checkAccess(cfg *config.Config, set *access.Set, logger *slog.Logger) error {
	switch {
	case set.Enforced():
		logger.Info("authentication on", "identities", set.Identities(), "mtls", cfg.TLS.ClientCAFile != "")
	case access.Loopback(cfg.Listen):
		logger.Info("authentication off: no identities in --config; loopback only")
	case cfg.AllowUnauthenticated:
		logger.Warn("authentication off: every caller may use every consumer (--allow-unauthenticated)")
	default:
		return fmt.Errorf("--listen %s is not a loopback address and --config names no identities, so every caller could use every consumer: add identities, or pass --allow-unauthenticated explicitly", cfg.Listen)
	}
	if set.HasTokens() && cfg.TLS.CertFile == "" && !access.Loopback(cfg.Listen) {
		logger.Warn("bearer tokens travel in plaintext: serve TLS unless a mesh encrypts the traffic")
	}
	return nil
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
			logger.Error("listener failed", "listener", "health", "error", err)
		}
	}()
	return nil
}

// startSweeper runs the sweeper in the background every --sweep-interval,
// until the returned function is called, which waits for it to stop.
func startSweeper(ctx context.Context, cfg *config.Config, store storage.Store, logger *slog.Logger) (stop func(), err error) {
	sw, ok := store.(storage.Sweeper)
	if cfg.Sweep.Interval == 0 || !ok {
		logger.Info("sweeper off", "sweep_interval", cfg.Sweep.Interval, "store_can_sweep", ok)
		return func() {}, nil
	}
	if ttl, err := config.RowLevelTTL(ctx, store); err != nil {
		return nil, fmt.Errorf("sweeper: %w", err)
	} else if ttl {
		logger.Info("sweeper off: CockroachDB's row-level TTL deletes expired records (idemreg migrate --cockroach-ttl)", "sweep_interval", cfg.Sweep.Interval)
		return func() {}, nil
	}
	sweeper, err := retention.New(sw, cfg.Sweeper(logger.With("component", "sweeper")))
	if err != nil {
		return nil, err
	}
	logger.Info("sweeper on", "sweep_interval", cfg.Sweep.Interval, "batch_size", cfg.Sweep.BatchSize)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); sweeper.Run(ctx) }()
	return func() { cancel(); <-done }, nil
}

// storeFailedExitTimeout bounds the cleanup after the store failed.
const storeFailedExitTimeout = 5 * time.Second
