// Package pgtest gives tests a fresh, migrated database of their own on a
// PostgreSQL (or CockroachDB) server, and drops it when the test ends.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemreg/idemreg/storage/postgres"
)

// EnvURL names the environment variable holding the URL of the server that
// tests create their databases on.
const EnvURL = "IDEMREG_TEST_DATABASE_URL"

// DefaultURL is the local PostgreSQL used when EnvURL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

const setupTimeout = 30 * time.Second

// ServerURL is the URL of the test server: EnvURL, or DefaultURL.
func ServerURL() string {
	if u := os.Getenv(EnvURL); u != "" {
		return u
	}
	return DefaultURL
}

// NewDatabase creates a uniquely named database on ServerURL, runs
// postgres.Migrate on it and returns its URL (the server's URL with the
// database's name as its path). The database is dropped in
// t.Cleanup, after the cleanups the test registers later (such as closing
// its stores).
func NewDatabase(t testing.TB) string {
	t.Helper()
	return NewDatabaseAt(t, ServerURL())
}

// NewDatabaseAt is NewDatabase on the server at serverURL, which must be a
// postgres:// or postgresql:// URL of a role that may create databases.
func NewDatabaseAt(t testing.TB, serverURL string) string {
	t.Helper()
	dbURL := NewEmptyDatabaseAt(t, serverURL)
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	if err := postgres.Migrate(ctx, dbURL); err != nil {
		t.Fatalf("pgtest: migrate: %v", err)
	}
	return dbURL
}

// NewEmptyDatabase is NewDatabase without the migration, for tests of
// migrating.
func NewEmptyDatabase(t testing.TB) string {
	t.Helper()
	return NewEmptyDatabaseAt(t, ServerURL())
}

// NewEmptyDatabaseAt is NewEmptyDatabase on the server at serverURL.
func NewEmptyDatabaseAt(t testing.TB, serverURL string) string {
	t.Helper()
	u, err := url.Parse(serverURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("pgtest: %s must be a postgres:// URL", EnvURL)
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()

	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		t.Fatalf("pgtest: cannot connect to the test database server %s: %v\n"+
			"Start the local PostgreSQL with:\n"+
			"    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n"+
			"or set %s to a server where this role may create databases.",
			u.Redacted(), err, EnvURL)
	}
	defer conn.Close(context.Background())

	var version string
	if err := conn.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		t.Fatalf("pgtest: read server version: %v", err)
	}
	cockroach := strings.Contains(version, "CockroachDB")

	name := "idemreg_test_" + randomSuffix(t)
	if _, err := conn.Exec(ctx, `CREATE DATABASE `+name); err != nil {
		t.Fatalf("pgtest: create database %s: %v", name, err)
	}
	t.Cleanup(func() { dropDatabase(t, serverURL, name, cockroach) })

	dbURL := *u
	dbURL.Path = "/" + name
	return dbURL.String()
}

func dropDatabase(t testing.TB, serverURL, name string, cockroach bool) {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		t.Errorf("pgtest: drop database %s: %v", name, err)
		return
	}
	defer conn.Close(ctx)
	// FORCE ends the sessions a failed test left open (PostgreSQL 13+);
	// CockroachDB has no such option and no need of it.
	drop := `DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`
	if cockroach {
		drop = `DROP DATABASE IF EXISTS ` + name + ` CASCADE`
	}
	if _, err := conn.Exec(ctx, drop); err != nil {
		t.Errorf("pgtest: drop database %s: %v", name, err)
	}
}

func randomSuffix(t testing.TB) string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return hex.EncodeToString(b)
}

// RequirePostgreSQL skips a test that relies on PostgreSQL's catalogs,
// functions or locking (pg_stat_activity, pg_current_xact_id_if_assigned,
// LOCK TABLE) when databaseURL is CockroachDB, saying which and why: the
// suites run against a cluster through the same URLs (docs/cockroachdb.md).
func RequirePostgreSQL(t testing.TB, databaseURL, why string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), databaseURL)
	if err != nil {
		t.Fatalf("pgtest: connect: %v", err)
	}
	defer conn.Close(context.Background())
	var version string
	if err := conn.QueryRow(t.Context(), `SELECT version()`).Scan(&version); err != nil {
		t.Fatalf("pgtest: read the server version: %v", err)
	}
	if strings.Contains(version, "CockroachDB") {
		t.Skipf("PostgreSQL only, skipped on CockroachDB: %s", why)
	}
}
