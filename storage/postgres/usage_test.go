package postgres_test

import (
	"os"
	"testing"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestUsageConformance(t *testing.T) {
	storagetest.RunUsage(t, sharedDatabase(pgtest.NewDatabase(t)))
	if serverURL := os.Getenv(envCockroachURL); serverURL != "" {
		t.Run("Cockroach", func(t *testing.T) {
			storagetest.RunUsage(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
		})
	}
}
