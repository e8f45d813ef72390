package postgres

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// migrationFiles holds the schema. migrations/*.sql run on both databases;
// migrations/cockroach/*.sql is laid over them on CockroachDB only, by file
// name: a file there replaces the base file of the same name (the
// hash-sharded primary key and expiry index) or adds one.
// migrations/cockroach-ttl/*.sql is added on CockroachDB when asked for
// (WithRowLevelTTL); its names start with ttl_ so that they sort after, and
// never replace, a base file.
//
//go:embed migrations/*.sql migrations/cockroach/*.sql migrations/cockroach-ttl/*.sql
var migrationFiles embed.FS

// VariantRowLevelTTL is the bookkeeping variant of the row-level TTL
// migrations: a store whose database has one applied must not be swept
// (RowLevelTTL).
const VariantRowLevelTTL = "cockroach-ttl"

// MigrateOption configures Migrate.
type MigrateOption func(*migrateOptions)

type migrateOptions struct{ rowLevelTTL bool }

// WithRowLevelTTL applies the row-level TTL variant on CockroachDB: the
// cluster deletes expired records itself and the expires_at index is
// dropped, so the sweeper must not run against that database. Migrate
// refuses it on PostgreSQL. Once applied it stays: running Migrate without
// it later does not undo it (migrations/cockroach-ttl says how).
func WithRowLevelTTL() MigrateOption {
	return func(o *migrateOptions) { o.rowLevelTTL = true }
}

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
// so every migration must be safe to repeat (IF NOT EXISTS).
//
// Concurrent runs (two deploy jobs, replicas migrating at start) take
// turns: a run holds the lock row of idemreg_migration_lock while it
// migrates, and another waits for it, until ctx ends. Advisory locks would
// do on PostgreSQL but are no-ops on CockroachDB; a row works on both. A
// run that dies holding the row leaves it to expire after MigrationLockTTL.
// The session is SERIALIZABLE whatever the role's default: CockroachDB
// refuses DDL in an explicit transaction at READ COMMITTED.
func Migrate(ctx context.Context, databaseURL string, opts ...MigrateOption) error {
	_, err := MigrateReport(ctx, databaseURL, opts...)
	return err
}

// Migration is one migration file as a database has it.
type Migration struct {
	// Name is the file's name, such as 0007_history_and_parked_index.sql;
	// its leading number is the schema version it brings.
	Name string
	// Variant is "base", "cockroach" or VariantRowLevelTTL.
	Variant string
	// AppliedAt is when the database recorded it; zero while pending.
	AppliedAt time.Time
}

// Version is the schema version m brings: the number its name starts with,
// or 0 for a name without one (the row-level TTL variant's).
func (m Migration) Version() int {
	n := 0
	for _, r := range m.Name {
		if r < '0' || r > '9' {
			break
		}
		n = n*10 + int(r-'0')
	}
	return n
}

// SchemaVersion is the highest version among applied.
func SchemaVersion(applied []Migration) int {
	v := 0
	for _, m := range applied {
		v = max(v, m.Version())
	}
	return v
}

// MigrateReport is Migrate, returning the migrations this run applied, in
// order (none when the schema was up to date), even with an error: those
// applied before the one that failed.
func MigrateReport(ctx context.Context, databaseURL string, opts ...MigrateOption) ([]Migration, error) {
	var o migrateOptions
	var done []Migration
	for _, opt := range opts {
		opt(&o)
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return done, fmt.Errorf("postgres migrate: connect: %w", withoutSecrets(err, databaseURL))
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `SET default_transaction_isolation = 'serializable'`); err != nil {
		return done, fmt.Errorf("postgres migrate: set isolation: %w", err)
	}
	unlock, err := lockMigrations(ctx, conn)
	if err != nil {
		return nil, err
	}
	defer unlock()

	var version string
	if err := conn.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		return done, fmt.Errorf("postgres migrate: read server version: %w", err)
	}
	cockroach := strings.Contains(version, "CockroachDB")
	if o.rowLevelTTL && !cockroach {
		return nil, errors.New("postgres migrate: row-level TTL needs CockroachDB; this database is not (sweep it with idemreg sweep or serve --sweep-interval)")
	}
	all, err := migrations(cockroach, o.rowLevelTTL)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, createMigrationsTable); err != nil {
		return done, fmt.Errorf("postgres migrate: create bookkeeping table: %w", err)
	}
	rows, err := conn.Query(ctx, `SELECT name FROM idemreg_schema_migrations`)
	if err != nil {
		return done, fmt.Errorf("postgres migrate: read applied migrations: %w", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return done, fmt.Errorf("postgres migrate: read applied migrations: %w", err)
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
			return done, fmt.Errorf("postgres migrate: %s (%s): %w", m.name, m.variant, err)
		}
		_, err = conn.Exec(ctx,
			`INSERT INTO idemreg_schema_migrations (name, variant) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING`,
			m.name, m.variant)
		if err != nil {
			return done, fmt.Errorf("postgres migrate: record %s: %w", m.name, err)
		}
		done = append(done, Migration{Name: m.name, Variant: m.variant, AppliedAt: time.Now()})
	}
	return done, nil
}

// MigrationStatus lists the migrations of the database at databaseURL:
// those it recorded as applied, in order, then those this binary would
// apply (Migrate with the same options), in order. It changes nothing and
// takes no lock, so it may run beside serve; a database never migrated has
// every migration pending. A recorded migration this binary does not know
// (a newer binary applied it) is listed among the applied ones.
func MigrationStatus(ctx context.Context, databaseURL string, opts ...MigrateOption) (applied, pending []Migration, err error) {
	var o migrateOptions
	for _, opt := range opts {
		opt(&o)
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return nil, nil, fmt.Errorf("postgres migrate status: connect: %w", withoutSecrets(err, databaseURL))
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var version string
	if err := conn.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		return nil, nil, fmt.Errorf("postgres migrate status: read server version: %w", err)
	}
	cockroach := strings.Contains(version, "CockroachDB")
	rows, err := conn.Query(ctx, `SELECT name, variant, applied_at FROM idemreg_schema_migrations ORDER BY name`)
	switch {
	case sqlState(err) == "42P01": // never migrated
	case err != nil:
		return nil, nil, fmt.Errorf("postgres migrate status: read applied migrations: %w", err)
	default:
		applied, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Migration, error) {
			var m Migration
			err := r.Scan(&m.Name, &m.Variant, &m.AppliedAt)
			return m, err
		})
		if err != nil {
			return nil, nil, fmt.Errorf("postgres migrate status: read applied migrations: %w", err)
		}
	}
	// A database migrated with the row-level TTL keeps it (WithRowLevelTTL).
	ttl := o.rowLevelTTL || slices.ContainsFunc(applied, func(m Migration) bool { return m.Variant == VariantRowLevelTTL })
	all, err := migrations(cockroach, ttl && cockroach)
	if err != nil {
		return nil, nil, err
	}
	for _, m := range all {
		if !slices.ContainsFunc(applied, func(a Migration) bool { return a.Name == m.name }) {
			pending = append(pending, Migration{Name: m.name, Variant: m.variant})
		}
	}
	return applied, pending, nil
}

// migrations lists the migrations to apply in order, with the CockroachDB
// overlay laid over the base set when cockroach is true, and the row-level
// TTL files added when ttl is too.
func migrations(cockroach, ttl bool) ([]migration, error) {
	byName := map[string]migration{}
	type dir struct{ dir, variant string }
	dirs := []dir{{"migrations", "base"}}
	if cockroach {
		dirs = append(dirs, dir{"migrations/cockroach", "cockroach"})
		if ttl {
			dirs = append(dirs, dir{"migrations/cockroach-ttl", VariantRowLevelTTL})
		}
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

// MigrationLockTTL is how long a Migrate holds the migration lock at most:
// far longer than the migrations take, so that a run that died holding it
// blocks the next ones for no longer than this.
const MigrationLockTTL = 10 * time.Minute

const createLockTable = `
CREATE TABLE IF NOT EXISTS idemreg_migration_lock (
    id         INT         NOT NULL PRIMARY KEY,
    holder     TEXT        NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
)`

// acquireLockSQL takes the lock row when it is free or expired, and
// returns the holder it leaves: this run's when it has the lock.
const acquireLockSQL = `
INSERT INTO idemreg_migration_lock AS l (id, holder, expires_at) VALUES (1, $1, now() + $2::INTERVAL)
ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
    WHERE l.expires_at < now()
RETURNING holder`

// lockWait is how often a waiting Migrate tries the lock again.
var lockWait = 100 * time.Millisecond

// lockMigrations waits for the migration lock and returns the function
// that releases it.
func lockMigrations(ctx context.Context, conn *pgx.Conn) (unlock func(), err error) {
	// Concurrent first runs race on creating the table itself:
	// PostgreSQL's catalog may refuse the loser of IF NOT EXISTS, on the
	// table's name (23505, 42P07) or on its row type's (42710).
	for attempt := 0; ; attempt++ {
		_, err = conn.Exec(ctx, createLockTable)
		if err == nil {
			break
		}
		if code := sqlState(err); (code != "23505" && code != "42P07" && code != "42710") || attempt >= 5 {
			return nil, fmt.Errorf("postgres migrate: create lock table: %w", err)
		}
	}
	holder := lockHolder()
	ttl := fmt.Sprintf("%d microseconds", MigrationLockTTL.Microseconds())
	for {
		var got string
		err := conn.QueryRow(ctx, acquireLockSQL, holder, ttl).Scan(&got)
		switch {
		case err == nil && got == holder:
			return func() {
				_, _ = conn.Exec(context.WithoutCancel(ctx), `DELETE FROM idemreg_migration_lock WHERE id = 1 AND holder = $1`, holder)
			}, nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows) && !retryable(err):
			return nil, fmt.Errorf("postgres migrate: take the migration lock: %w", err)
		}
		select {
		case <-ctx.Done():
			var other string
			var until time.Time
			_ = conn.QueryRow(context.WithoutCancel(ctx), `SELECT holder, expires_at FROM idemreg_migration_lock WHERE id = 1`).Scan(&other, &until)
			return nil, fmt.Errorf("postgres migrate: another migrate (%s) holds the migration lock until %s: %w", other, until.UTC().Format(time.RFC3339), ctx.Err())
		case <-time.After(lockWait):
		}
	}
}

// lockHolder names this run in the lock row, for whoever waits on it.
func lockHolder() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), rand.Text()[:8])
}

// RowLevelTTL reports whether the database was migrated with
// WithRowLevelTTL: CockroachDB's TTL job deletes its expired records and the
// expires_at index is gone, so a sweeper must not run against it (its scan
// would read the whole table). False on a database never migrated.
func (s *Store) RowLevelTTL(ctx context.Context) (bool, error) {
	var ttl bool
	err := s.run(ctx, "row-level ttl", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx,
			`SELECT EXISTS (SELECT 1 FROM idemreg_schema_migrations WHERE variant = $1)`, VariantRowLevelTTL).Scan(&ttl)
	})
	if sqlState(err) == "42P01" {
		return false, nil
	}
	return ttl, err
}
