package postgres_test

import (
	"os"
	"testing"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

const envCockroachURL = "IDEMREG_TEST_COCKROACH_URL"

// sharedDatabase serves the suite's areas whose cases use keys of their
// own (storagetest.Shared).
func sharedDatabase(databaseURL string) storagetest.Factory {
	return func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openStore(t, databaseURL, postgres.WithClockOffset(c.Offset))
	}
}

// freshDatabases gives every case a database of its own, for the suite's
// areas whose cases count what the store holds (sweeps, members, keys).
func freshDatabases(serverURL string) storagetest.Factory {
	return func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openStore(t, pgtest.NewDatabaseAt(t, serverURL), postgres.WithClockOffset(c.Offset))
	}
}

// conformance runs the whole suite on the PostgreSQL-wire server at
// serverURL: one database shared where the cases allow it, one per case
// where they count what the store holds.
func conformance(t *testing.T, serverURL string) {
	storagetest.All(t, freshDatabases(serverURL), storagetest.Shared(sharedDatabase(pgtest.NewDatabaseAt(t, serverURL))))
}

func TestConformance(t *testing.T) {
	conformance(t, pgtest.ServerURL())
}

// TestCockroach runs the same suite on CockroachDB, every area included.
func TestCockroach(t *testing.T) {
	serverURL := os.Getenv(envCockroachURL)
	if serverURL == "" {
		t.Skip(envCockroachURL + " not set: CockroachDB conformance not run (no cluster on this machine)")
	}
	conformance(t, serverURL)
}
