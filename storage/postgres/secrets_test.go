package postgres_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestClaimKeysConformance(t *testing.T) {
	storagetest.RunClaimKeys(t, freshDatabases(pgtest.ServerURL()))
}

// TestClaimKeySharedByServers: servers on one database start together and
// all derive claim secrets from the same key.
func TestClaimKeySharedByServers(t *testing.T) {
	db := pgtest.NewDatabase(t)
	const servers = 4
	keys := make([][]byte, servers)
	errs := make([]error, servers)
	var wg sync.WaitGroup
	for i := range servers {
		s := openStore(t, db)
		wg.Go(func() { keys[i], errs[i] = s.ClaimKey(t.Context()) })
	}
	wg.Wait()
	for i := range servers {
		require.NoError(t, errs[i])
		require.Equal(t, keys[0], keys[i], "server %d got another key", i)
	}
	later, err := openStore(t, db).ClaimKey(t.Context())
	require.NoError(t, err)
	require.Equal(t, keys[0], later, "a server started later got another key")
}
