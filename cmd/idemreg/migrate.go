package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"

	"github.com/idemreg/idemreg/storage/postgres"
)

// migrateCommand binds the flags of migrate, which applies the SQL schema:
// the database's URL and the CockroachDB variant, nothing of serve's.
func migrateCommand(fs *flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	databaseURL := fs.String("database-url", "", "PostgreSQL or CockroachDB URL (postgres://...) of the database to migrate (required: the embedded store needs no migration)")
	ttl := fs.Bool("cockroach-ttl", false, "CockroachDB only: let the cluster's row-level TTL delete expired records and drop the expires_at index; nothing may sweep the database after it")
	return func(ctx context.Context, stdout, _ io.Writer) error {
		if *databaseURL == "" {
			return errors.New("migrate needs --database-url (or IDEMREG_DATABASE_URL); the embedded store needs no migration")
		}
		if err := validDatabaseURL(*databaseURL); err != nil {
			return err
		}
		var opts []postgres.MigrateOption
		if *ttl {
			opts = append(opts, postgres.WithRowLevelTTL())
		}
		if err := postgres.Migrate(ctx, *databaseURL, opts...); err != nil {
			return fmt.Errorf("migrating %s: %w", postgres.Redact(*databaseURL), err)
		}
		fmt.Fprintln(stdout, "schema is up to date:", postgres.Redact(*databaseURL))
		return nil
	}
}

// validDatabaseURL refuses a URL the SQL store cannot open, naming it
// redacted.
func validDatabaseURL(s string) error {
	if u, err := url.Parse(s); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return fmt.Errorf("--database-url must be a postgres:// URL, got %q", postgres.Redact(s))
	}
	return nil
}
