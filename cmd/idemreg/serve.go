package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
)

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("idemreg serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg.bind(fs, true)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	logger := cfg.logger(stderr)

	store, err := openStore(ctx, &cfg, logger)
	if err != nil {
		return err
	}
	defer store.Close()

	srv, err := server.New(store, server.Config{Limits: cfg.Limits, Logger: logger})
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", cfg.Listen, err)
	}
	logger.Info("serving", "listen", lis.Addr().String())
	if err := srv.Serve(ctx, lis); err != nil {
		return err
	}
	logger.Info("stopped")
	return nil
}

// openStore opens the SQL store when a database URL is given, the embedded
// store in the data directory otherwise.
func openStore(ctx context.Context, cfg *config, logger *slog.Logger) (storage.Store, error) {
	if cfg.DatabaseURL != "" {
		logger.Info("opening SQL store", "database_url", redact(cfg.DatabaseURL))
		s, err := postgres.Open(ctx, cfg.DatabaseURL, postgres.WithLogger(logger))
		if err != nil {
			return nil, fmt.Errorf("opening %s: %w", redact(cfg.DatabaseURL), err)
		}
		return s, nil
	}
	logger.Info("opening embedded store", "data_dir", cfg.DataDir)
	s, err := pebble.Open(cfg.DataDir, pebble.WithLogger(logger))
	if err != nil {
		return nil, err
	}
	return s, nil
}
