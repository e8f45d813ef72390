package config

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
)

// ExitStoreFailed is serve's exit status when its store failed for good
// (server.ErrStoreFailed) or its data directory's file system is full at
// start: EX_TEMPFAIL, a failure a restart may cure once the cause is gone.
const ExitStoreFailed = 75

// PingTimeout bounds a look at the store before its work starts: its
// ping, and whether its database deletes expired records itself.
const PingTimeout = 10 * time.Second

// StoreKind names the store that OpenStore opens, for the startup line.
func (c *Config) StoreKind() string {
	if c.DatabaseURL != "" {
		return "postgres"
	}
	return "embedded"
}

// OpenStore opens the SQL store when a database URL is given, the embedded
// store in the data directory otherwise; the SQL store's instruments are
// made by meters (nil: the global provider). A full file system under the
// embedded store exits ExitStoreFailed.
func (c *Config) OpenStore(ctx context.Context, logger *slog.Logger, meters metric.MeterProvider) (storage.Store, error) {
	if c.DatabaseURL != "" {
		logger.Info("opening SQL store", "database_url", postgres.Redact(c.DatabaseURL))
		s, err := postgres.Open(ctx, c.DatabaseURL, postgres.WithLogger(logger),
			postgres.WithBatching(c.SQLBatchSize, c.SQLBatchWindow, c.SQLBatchSlots),
			postgres.WithMeterProvider(meters))
		if err != nil {
			return nil, fmt.Errorf("opening %s: %w", postgres.Redact(c.DatabaseURL), err)
		}
		return s, nil
	}
	logger.Info("opening embedded store", "data_dir", c.DataDir)
	s, err := pebble.Open(c.DataDir, pebble.WithLogger(logger), pebble.WithMeterProvider(meters),
		pebble.WithDiskReserve(c.DataDirReserve))
	if errors.Is(err, syscall.ENOSPC) {
		return nil, command.Exit(ExitStoreFailed, fmt.Errorf(
			"the file system of --data-dir %s is full, so the embedded store cannot open (nothing acknowledged is lost): free space or grow the file system, then start again: %w", c.DataDir, err))
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

// ExistingStore refuses an embedded store that is not there, for the
// commands that work on one serve made: pebble.Open would create an empty
// store, so a mistyped directory would pass for a swept one, or get a key
// no server ever used.
func (c *Config) ExistingStore() error {
	if c.DatabaseURL != "" {
		return nil
	}
	if st, err := os.Stat(c.DataDir); err != nil || !st.IsDir() {
		return fmt.Errorf("no embedded store in --data-dir %s (give --database-url for PostgreSQL or CockroachDB)", c.DataDir)
	}
	return nil
}

// RowLevelTTL reports whether store's database deletes expired records
// itself (postgres.Store.RowLevelTTL), so that nothing may sweep it.
func RowLevelTTL(ctx context.Context, store storage.Store) (bool, error) {
	s, ok := store.(interface {
		RowLevelTTL(context.Context) (bool, error)
	})
	if !ok {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(ctx, PingTimeout)
	defer cancel()
	return s.RowLevelTTL(ctx)
}

// ValidDatabaseURL refuses a URL the SQL store cannot open, naming it
// redacted.
func ValidDatabaseURL(s string) error {
	if u, err := url.Parse(s); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return fmt.Errorf("--database-url must be a postgres:// URL, got %q", postgres.Redact(s))
	}
	return nil
}
