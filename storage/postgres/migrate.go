package postgres

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// migrationFiles holds the schema. migrations/*.sql run on both databases;
// migrations/cockroach/*.sql is laid over them on CockroachDB only, by file
// name: a file there replaces the base file of the same name (the
// hash-sharded expiry index) or adds one.
//
//go:embed migrations/*.sql migrations/cockroach/*.sql
var migrationFiles embed.FS

const createMigrationsTable = `
CREATE TABLE IF NOT EXISTS idemreg_schema_migrations (
    name       TEXT        NOT NULL PRIMARY KEY,
    variant    TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`

type migration struct {
	name    string // file name, the bookkeeping key
	variant string // "base" or "cockroach"
	sql     string
}

// Migrate brings the schema of the database at databaseURL up to date. It
// is idempotent: migrations already recorded in idemreg_schema_migrations
// are skipped.
//
// Each migration runs in its own transaction, and its bookkeeping row is
// written in a second one, because CockroachDB restricts DDL and DML in one
// transaction. A crash between the two runs the migration again next time,
// so every migration must be safe to repeat (IF NOT EXISTS). Run Migrate
// from one process at a time (a deploy step): two concurrent runs may fail
// on PostgreSQL's catalog, harmlessly, and the failed one can be rerun.
func Migrate(ctx context.Context, databaseURL string) error {
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return fmt.Errorf("postgres migrate: connect: %w", withoutSecrets(err, databaseURL))
	}
	defer conn.Close(context.WithoutCancel(ctx))

	var version string
	if err := conn.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		return fmt.Errorf("postgres migrate: read server version: %w", err)
	}
	all, err := migrations(strings.Contains(version, "CockroachDB"))
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, createMigrationsTable); err != nil {
		return fmt.Errorf("postgres migrate: create bookkeeping table: %w", err)
	}
	rows, err := conn.Query(ctx, `SELECT name FROM idemreg_schema_migrations`)
	if err != nil {
		return fmt.Errorf("postgres migrate: read applied migrations: %w", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("postgres migrate: read applied migrations: %w", err)
	}
	for _, m := range all {
		if slices.Contains(applied, m.name) {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			// No arguments: pgx sends the file as one simple-protocol
			// query, so a file may hold several statements.
			_, err := tx.Exec(ctx, m.sql)
			return err
		})
		if err != nil {
			return fmt.Errorf("postgres migrate: %s (%s): %w", m.name, m.variant, err)
		}
		_, err = conn.Exec(ctx,
			`INSERT INTO idemreg_schema_migrations (name, variant) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING`,
			m.name, m.variant)
		if err != nil {
			return fmt.Errorf("postgres migrate: record %s: %w", m.name, err)
		}
	}
	return nil
}

// migrations lists the migrations to apply in order, with the CockroachDB
// overlay laid over the base set when cockroach is true.
func migrations(cockroach bool) ([]migration, error) {
	byName := map[string]migration{}
	dirs := []struct{ dir, variant string }{{"migrations", "base"}}
	if cockroach {
		dirs = append(dirs, struct{ dir, variant string }{"migrations/cockroach", "cockroach"})
	}
	for _, d := range dirs {
		entries, err := fs.ReadDir(migrationFiles, d.dir)
		if err != nil {
			return nil, fmt.Errorf("postgres migrate: %w", err)
		}
		for _, e := range entries {
			if e.IsDir() || !strings.HasSuffix(e.Name(), ".sql") {
				continue
			}
			b, err := fs.ReadFile(migrationFiles, path.Join(d.dir, e.Name()))
			if err != nil {
				return nil, fmt.Errorf("postgres migrate: %w", err)
			}
			byName[e.Name()] = migration{name: e.Name(), variant: d.variant, sql: string(b)}
		}
	}
	out := make([]migration, 0, len(byName))
	for _, m := range byName {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b migration) int { return strings.Compare(a.name, b.name) })
	return out, nil
}
