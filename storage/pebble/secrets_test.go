package pebble

import (
	"bytes"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// TestClaimKeySurvivesRestart: claims acquired before a restart can still
// be completed after it.
func TestClaimKeySurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)
	before, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	rotated, err := s.RotateClaimKey(t.Context(), storage.RotateClaimKeyParams{ActivateAfter: time.Minute, Grace: time.Hour})
	require.NoError(t, err)
	require.Equal(t, before.Keys[0].Key, rotated.Keys[1].Key)
	require.NoError(t, s.Close())
	after, err := openT(t, dir).ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Equal(t, rotated.Keys, after.Keys, "the generations, next and previous, survive a restart")
}

// TestClaimKeyFromLegacyDirectory: a data directory written before keys
// had generations keeps its key as generation 1, so that claims acquired
// before the upgrade can be completed after it.
func TestClaimKeyFromLegacyDirectory(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)
	legacy := bytes.Repeat([]byte{7}, storage.ClaimKeySize)
	require.NoError(t, s.db.Set(metaClaimKey, legacy, pebble.Sync))
	ring, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Len(t, ring.Keys, 1)
	require.EqualValues(t, 1, ring.Keys[0].Generation)
	require.Equal(t, legacy, ring.Keys[0].Key)
	require.NoError(t, s.Close())
}
