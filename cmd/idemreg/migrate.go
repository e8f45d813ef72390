package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/idemreg/idemreg/storage/postgres"
)

func migrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("idemreg migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg.bind(fs, false)
	if err := parse(fs, args); err != nil {
		return err
	}
	if cfg.DatabaseURL == "" {
		return errors.New("migrate needs --database-url (or IDEMREG_DATABASE_URL); the embedded store needs no migration")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := postgres.Migrate(ctx, cfg.DatabaseURL); err != nil {
		return fmt.Errorf("migrating %s: %w", postgres.Redact(cfg.DatabaseURL), err)
	}
	fmt.Fprintln(stdout, "schema is up to date:", postgres.Redact(cfg.DatabaseURL))
	return nil
}
