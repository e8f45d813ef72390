package postgres_test

import (
	"os"
	"testing"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestAdminConformance(t *testing.T) {
	storagetest.RunAdmin(t, sharedDatabase(pgtest.NewDatabase(t)))
	if serverURL := os.Getenv(envCockroachURL); serverURL != "" {
		t.Run("Cockroach", func(t *testing.T) {
			storagetest.RunAdmin(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
		})
	}
}
