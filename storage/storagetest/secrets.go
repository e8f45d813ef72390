package storagetest

import (
	"bytes"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// RunClaimKeys runs the cases of the storage.ClaimKeys capability against
// the stores newStore makes, which must implement it. That the key
// survives a restart and is shared by stores on one backend depends on
// the backend; its own tests check that.
func RunClaimKeys(t *testing.T, newStore Factory) {
	t.Helper()
	cases := []struct {
		name string
		fn   func(t *testing.T, k storage.ClaimKeys)
	}{
		{"Stable", testClaimKeyStable},
		{"RaceFirstUse", testClaimKeyRace},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, &Clock{})
			k, ok := s.(storage.ClaimKeys)
			require.True(t, ok, "%T does not implement storage.ClaimKeys", s)
			tc.fn(t, k)
		})
	}
}

func testClaimKeyStable(t *testing.T, k storage.ClaimKeys) {
	first, err := k.ClaimKey(t.Context())
	require.NoError(t, err)
	require.Len(t, first, storage.ClaimKeySize)
	require.NotEqual(t, make([]byte, storage.ClaimKeySize), first, "a key of zeros is no secret")
	again, err := k.ClaimKey(t.Context())
	require.NoError(t, err)
	require.Equal(t, first, again)
}

// testClaimKeyRace: concurrent first calls agree on one key.
func testClaimKeyRace(t *testing.T, k storage.ClaimKeys) {
	const callers = 16
	keys := make([][]byte, callers)
	errs := make([]error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() { keys[i], errs[i] = k.ClaimKey(t.Context()) })
	}
	wg.Wait()
	for i := range callers {
		require.NoError(t, errs[i])
		require.True(t, bytes.Equal(keys[0], keys[i]), "caller %d got another key", i)
	}
}
