package storagetest

import (
	"bytes"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// claimKeysCases are the cases of the storage.ClaimKeys capability. Each
// needs a store of its own: they read its first key. That the keys
// survive a restart and are shared by stores on one backend depends on
// the backend; its own tests check that.
var claimKeysCases = []capabilityCase[storage.ClaimKeys]{
	{"Stable", testClaimKeyStable},
	{"RaceFirstUse", testClaimKeyRace},
	{"Rotate", testClaimKeyRotate},
	{"RotateWithinGrace", testClaimKeyRotateWithinGrace},
}

func testClaimKeyStable(t *testing.T, k storage.ClaimKeys, _ *Clock) {
	first, err := k.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Len(t, first.Keys, 1)
	key := first.Keys[0]
	require.EqualValues(t, 1, key.Generation)
	require.Len(t, key.Key, storage.ClaimKeySize)
	require.NotEqual(t, make([]byte, storage.ClaimKeySize), key.Key, "a key of zeros is no secret")
	require.True(t, key.AcceptUntil.IsZero(), "the only key has no end")
	require.False(t, first.Now.IsZero())
	require.Equal(t, key.Generation, first.Current(first.Now).Generation)
	again, err := k.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Equal(t, first.Keys, again.Keys)
}

// testClaimKeyRace: concurrent first calls agree on one key.
func testClaimKeyRace(t *testing.T, k storage.ClaimKeys, _ *Clock) {
	const callers = 16
	rings := make([]storage.ClaimKeyRing, callers)
	errs := make([]error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() { rings[i], errs[i] = k.ClaimKeyRing(t.Context()) })
	}
	wg.Wait()
	for i := range callers {
		require.NoError(t, errs[i])
		require.Len(t, rings[i].Keys, 1)
		require.True(t, bytes.Equal(rings[0].Keys[0].Key, rings[i].Keys[0].Key), "caller %d got another key", i)
	}
}

// testClaimKeyRotate: a rotation adds generation 2, next until its
// activation, and keeps generation 1 accepted for the grace after that,
// by the store's clock; then generation 1 is gone.
func testClaimKeyRotate(t *testing.T, k storage.ClaimKeys, c *Clock) {
	ctx := t.Context()
	before, err := k.ClaimKeyRing(ctx)
	require.NoError(t, err)
	const activate, grace = time.Minute, 2 * time.Hour
	after, err := k.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: activate, Grace: grace})
	require.NoError(t, err)
	require.Len(t, after.Keys, 2)
	next, prev := after.Keys[0], after.Keys[1]
	require.EqualValues(t, 2, next.Generation)
	require.EqualValues(t, 1, prev.Generation)
	require.Equal(t, before.Keys[0].Key, prev.Key, "the key in use stays the same")
	require.NotEqual(t, prev.Key, next.Key)
	require.Len(t, next.Key, storage.ClaimKeySize)
	require.True(t, next.AcceptUntil.IsZero())
	require.WithinDuration(t, after.Now.Add(activate), next.ActiveFrom, 5*time.Second)
	require.Equal(t, next.ActiveFrom.Add(grace), prev.AcceptUntil)

	require.EqualValues(t, 1, after.Current(after.Now).Generation, "the new key is next, not current, until its activation")
	require.EqualValues(t, 2, after.Current(next.ActiveFrom).Generation)

	read, err := k.ClaimKeyRing(ctx)
	require.NoError(t, err)
	require.Equal(t, after.Keys, read.Keys, "a later read sees the rotation")

	c.Advance(activate + grace - time.Minute)
	read, err = k.ClaimKeyRing(ctx)
	require.NoError(t, err)
	require.Len(t, read.Keys, 2, "within the grace the replaced key is accepted")
	require.EqualValues(t, 2, read.Current(read.Now).Generation)

	c.Advance(2 * time.Minute)
	read, err = k.ClaimKeyRing(ctx)
	require.NoError(t, err)
	require.Len(t, read.Keys, 1, "after the grace the replaced key is gone")
	require.Equal(t, next.Key, read.Keys[0].Key)
	require.EqualValues(t, 2, read.Current(read.Now).Generation)
}

// testClaimKeyRotateWithinGrace: a second rotation within the first's
// grace leaves the first's end as it was, and a rotation after it drops
// the generations that ended.
func testClaimKeyRotateWithinGrace(t *testing.T, k storage.ClaimKeys, c *Clock) {
	ctx := t.Context()
	first, err := k.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: time.Minute, Grace: time.Hour})
	require.NoError(t, err)
	c.Advance(10 * time.Minute)
	second, err := k.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: time.Minute, Grace: time.Hour})
	require.NoError(t, err)
	require.Len(t, second.Keys, 3)
	require.Equal(t, []int64{3, 2, 1}, []int64{second.Keys[0].Generation, second.Keys[1].Generation, second.Keys[2].Generation})
	require.Equal(t, first.Keys[1].AcceptUntil, second.Keys[2].AcceptUntil, "generation 1 keeps its end")
	require.Equal(t, second.Keys[0].ActiveFrom.Add(time.Hour), second.Keys[1].AcceptUntil)

	c.Advance(2 * time.Hour)
	third, err := k.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: 0, Grace: time.Hour})
	require.NoError(t, err)
	require.Len(t, third.Keys, 2)
	require.Equal(t, []int64{4, 3}, []int64{third.Keys[0].Generation, third.Keys[1].Generation})
	require.EqualValues(t, 4, third.Current(third.Now).Generation)
}
