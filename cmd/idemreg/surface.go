package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/idemreg/idemreg/internal/telemetry"
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
	telemetry *telemetry.Pipeline
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

	if s.telemetry, err = telemetry.Start(ctx, "idemreg", logger); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, s.telemetry.Shutdown)
	if cfg.MetricsListen != "" {
		stop, err := serveMetrics(cfg.MetricsListen, s.telemetry.Metrics(), logger)
		if err != nil {
			return nil, err
		}
		s.closers = append(s.closers, stop)
	}
	return s, nil
}

// serveMetrics serves the registry on http://addr/metrics until the
// returned function is called.
func serveMetrics(addr string, metrics http.Handler, logger *slog.Logger) (stop func(), err error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listening on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
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
