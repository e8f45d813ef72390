package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestRotateClaimKey: rotate-claim-key adds generation 2 on the database
// and on a data directory, prints generations and times and never a key.
func TestRotateClaimKey(t *testing.T) {
	db := pgtest.NewDatabase(t)
	s, err := postgres.Open(t.Context(), db)
	require.NoError(t, err)
	defer s.Close()
	before, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)

	var out, errOut bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"rotate-claim-key", "--database-url", db, "--grace", "90m"}, &out, &errOut))
	require.Contains(t, out.String(), "claim key generation 2 added")
	require.Contains(t, out.String(), "generation 1 accepted until")
	after, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Len(t, after.Keys, 2)
	require.Equal(t, before.Keys[0].Key, after.Keys[1].Key)
	require.Equal(t, after.Keys[0].ActiveFrom.Add(90*60e9), after.Keys[1].AcceptUntil)
	for _, k := range after.Keys {
		require.NotContains(t, strings.ToLower(out.String()+errOut.String()), strings.ToLower(string(k.Key)))
	}

	dir := t.TempDir()
	p, err := pebble.Open(dir)
	require.NoError(t, err)
	_, err = p.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	err = run(t.Context(), []string{"rotate-claim-key", "--data-dir", dir}, &out, &errOut)
	require.ErrorIs(t, err, pebble.ErrLocked, "a running serve holds the directory")
	require.NoError(t, p.Close())
	out.Reset()
	require.NoError(t, run(t.Context(), []string{"rotate-claim-key", "--data-dir", dir}, &out, &errOut))
	require.Contains(t, out.String(), "claim key generation 2 added")

	require.Error(t, run(t.Context(), []string{"rotate-claim-key", "--data-dir", t.TempDir() + "/missing"}, &out, &errOut))
}
