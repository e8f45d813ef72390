package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/idemreg/idemreg/storage/postgres"
)

func migrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("idemreg migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.DatabaseURL, "database-url", cfg.DatabaseURL, "PostgreSQL or CockroachDB URL (postgres://...); empty uses the embedded store in --data-dir")
	ttl := fs.Bool("cockroach-ttl", os.Getenv("IDEMREG_COCKROACH_TTL") == "true",
		"CockroachDB only: let the cluster's row-level TTL delete expired records and drop the expires_at index; nothing may sweep the database after it (env IDEMREG_COCKROACH_TTL=true)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if cfg.DatabaseURL == "" {
		return errors.New("migrate needs --database-url (or IDEMREG_DATABASE_URL); the embedded store needs no migration")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	var opts []postgres.MigrateOption
	if *ttl {
		opts = append(opts, postgres.WithRowLevelTTL())
	}
	if err := postgres.Migrate(ctx, cfg.DatabaseURL, opts...); err != nil {
		return fmt.Errorf("migrating %s: %w", postgres.Redact(cfg.DatabaseURL), err)
	}
	fmt.Fprintln(stdout, "schema is up to date:", postgres.Redact(cfg.DatabaseURL))
	return nil
}
