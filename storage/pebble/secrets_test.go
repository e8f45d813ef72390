package pebble

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestClaimKeysConformance(t *testing.T) {
	storagetest.RunClaimKeys(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, t.TempDir(), WithClock(c.Now))
	})
}

// TestClaimKeySurvivesRestart: claims acquired before a restart can still
// be completed after it.
func TestClaimKeySurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)
	before, err := s.ClaimKey(t.Context())
	require.NoError(t, err)
	require.NoError(t, s.Close())
	after, err := openT(t, dir).ClaimKey(t.Context())
	require.NoError(t, err)
	require.Equal(t, before, after)
}
