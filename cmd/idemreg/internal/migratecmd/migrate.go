// Package migratecmd is idemreg migrate, which applies the SQL schema to a
// database and lists what it applied, and idemreg migrate status, which
// lists the applied and pending migrations and changes nothing.
package migratecmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/storage/postgres"
)

// ExitPending is the exit status of migrate status when the database
// lacks migrations this binary would apply: an init container or a deploy
// check can wait for it to turn 0. Errors exit 2, as elsewhere.
const ExitPending = 3

// Migrate binds the flags of migrate, which applies the SQL schema: the
// database's URL and the CockroachDB variant, nothing of serve's.
func Migrate(fs *flag.FlagSet) command.Run {
	databaseURL, ttl := bindMigrate(fs)
	return func(ctx context.Context, stdout, _ io.Writer) error {
		opts, err := migrateOptions(*databaseURL, *ttl)
		if err != nil {
			return err
		}
		applied, err := postgres.MigrateReport(ctx, *databaseURL, opts...)
		for _, m := range applied {
			fmt.Fprintf(stdout, "applied %s (%s)\n", m.Name, m.Variant)
		}
		if err != nil {
			return fmt.Errorf("migrating %s: %w", postgres.Redact(*databaseURL), err)
		}
		// The version is the database's, which the applied rows alone do
		// not give when earlier runs applied the rest.
		all, _, err := postgres.MigrationStatus(ctx, *databaseURL, opts...)
		if err != nil {
			return fmt.Errorf("reading the schema version of %s: %w", postgres.Redact(*databaseURL), err)
		}
		if len(applied) == 0 {
			fmt.Fprintf(stdout, "schema is up to date at version %d: %s\n", postgres.SchemaVersion(all), postgres.Redact(*databaseURL))
			return nil
		}
		fmt.Fprintf(stdout, "schema at version %d (%s applied now): %s\n", postgres.SchemaVersion(all), plural(len(applied), "migration"), postgres.Redact(*databaseURL))
		return nil
	}
}

// Status binds the flags of migrate status, which lists the database's
// applied and pending migrations and changes nothing.
func Status(fs *flag.FlagSet) command.Run {
	databaseURL, ttl := bindMigrate(fs)
	return func(ctx context.Context, stdout, _ io.Writer) error {
		opts, err := migrateOptions(*databaseURL, *ttl)
		if err != nil {
			return err
		}
		applied, pending, err := postgres.MigrationStatus(ctx, *databaseURL, opts...)
		if err != nil {
			return fmt.Errorf("%s: %w", postgres.Redact(*databaseURL), err)
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "MIGRATION\tVARIANT\tSTATE\tAPPLIED AT")
		for _, m := range applied {
			fmt.Fprintf(tw, "%s\t%s\tapplied\t%s\n", m.Name, m.Variant, m.AppliedAt.UTC().Format(time.DateTime+" MST"))
		}
		for _, m := range pending {
			fmt.Fprintf(tw, "%s\t%s\tpending\t-\n", m.Name, m.Variant)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		version := postgres.SchemaVersion(applied)
		if len(pending) == 0 {
			fmt.Fprintf(stdout, "schema is up to date at version %d: %s\n", version, postgres.Redact(*databaseURL))
			return nil
		}
		fmt.Fprintf(stdout, "schema at version %d, %s pending: %s\n", version, plural(len(pending), "migration"), postgres.Redact(*databaseURL))
		return command.Exit(ExitPending, fmt.Errorf(
			"%s pending: run idemreg migrate (exit status %d)", plural(len(pending), "migration"), ExitPending))
	}
}

func bindMigrate(fs *flag.FlagSet) (databaseURL *string, ttl *bool) {
	databaseURL, ttl = new(string), new(bool)
	cmdline.Bind(fs, cmdline.String(databaseURL, "database-url", "PostgreSQL or CockroachDB URL (postgres://...) of the database to migrate (required: the embedded store needs no migration)"),
		cmdline.Bool(ttl, "cockroach-ttl", "CockroachDB only: let the cluster's row-level TTL delete expired records and drop the expires_at index; nothing may sweep the database after it"))
	return databaseURL, ttl
}

func migrateOptions(databaseURL string, ttl bool) ([]postgres.MigrateOption, error) {
	if databaseURL == "" {
		return nil, errors.New("migrate needs --database-url (or IDEMREG_DATABASE_URL); the embedded store needs no migration: serve upgrades its layout when it opens it")
	}
	if err := config.ValidDatabaseURL(databaseURL); err != nil {
		return nil, err
	}
	var opts []postgres.MigrateOption
	if ttl {
		opts = append(opts, postgres.WithRowLevelTTL())
	}
	return opts, nil
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
