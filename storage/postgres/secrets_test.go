package postgres_test

import (
	"bytes"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestClaimKeySharedByServers: servers on one database start together and
// all derive claim secrets from the same key.
func TestClaimKeySharedByServers(t *testing.T) {
	db := pgtest.NewDatabase(t)
	const servers = 4
	keys := make([]storage.ClaimKeyRing, servers)
	errs := make([]error, servers)
	var wg sync.WaitGroup
	for i := range servers {
		s := openStore(t, db)
		wg.Go(func() { keys[i], errs[i] = s.ClaimKeyRing(t.Context()) })
	}
	wg.Wait()
	for i := range servers {
		require.NoError(t, errs[i])
		require.Equal(t, keys[0].Keys, keys[i].Keys, "server %d got another key", i)
	}
	later, err := openStore(t, db).ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Equal(t, keys[0].Keys, later.Keys, "a server started later got another key")
}

// TestClaimKeyRotationSharedByServers: a rotation through one server is
// what every other server on the database reads next.
func TestClaimKeyRotationSharedByServers(t *testing.T) {
	db := pgtest.NewDatabase(t)
	a, b := openStore(t, db), openStore(t, db)
	before, err := b.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	rotated, err := a.RotateClaimKey(t.Context(), storage.RotateClaimKeyParams{ActivateAfter: time.Minute, Grace: time.Hour})
	require.NoError(t, err)
	seen, err := b.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Equal(t, rotated.Keys, seen.Keys)
	require.Equal(t, before.Keys[0].Key, seen.Keys[1].Key)
}

// TestClaimKeyFromLegacyRow: a database whose servers predate versioned
// keys keeps its idemreg_secrets key as generation 1, so that servers of
// both versions agree until the first rotation.
func TestClaimKeyFromLegacyRow(t *testing.T) {
	db := pgtest.NewDatabase(t)
	s := openStore(t, db)
	legacy := bytes.Repeat([]byte{7}, storage.ClaimKeySize)
	conn, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	defer conn.Close(t.Context())
	_, err = conn.Exec(t.Context(), `INSERT INTO idemreg_secrets (name, value) VALUES ('claim', $1)`, legacy)
	require.NoError(t, err)
	ring, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Len(t, ring.Keys, 1)
	require.EqualValues(t, 1, ring.Keys[0].Generation)
	require.Equal(t, legacy, ring.Keys[0].Key)
}
