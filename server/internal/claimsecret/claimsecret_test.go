package claimsecret_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

var k = storage.Key{Consumer: "billing.worker", Kind: storage.KindOperation, Key: "charge-1"}

// TestDerive: a secret is Size bytes, the same for the same inputs, and
// different when the key, the record's key or the token differs.
func TestDerive(t *testing.T) {
	key := bytes.Repeat([]byte{7}, storage.ClaimKeySize)
	s := claimsecret.Derive(key, k, 42)
	require.Len(t, s, claimsecret.Size)
	assert.Equal(t, s, claimsecret.Derive(key, k, 42))
	other := k
	other.Key = "charge-2"
	otherKind := k
	otherKind.Kind = storage.KindMessage
	// Length-prefixed fields: "ab"+"c" and "a"+"bc" differ.
	shifted := storage.Key{Consumer: "billing.worke", Kind: k.Kind, Key: "rcharge-1"}
	for name, d := range map[string][]byte{
		"token":     claimsecret.Derive(key, k, 43),
		"key":       claimsecret.Derive(key, other, 42),
		"kind":      claimsecret.Derive(key, otherKind, 42),
		"shifted":   claimsecret.Derive(key, shifted, 42),
		"claim key": claimsecret.Derive(bytes.Repeat([]byte{8}, storage.ClaimKeySize), k, 42),
	} {
		assert.NotEqual(t, s, d, name)
	}
}

// TestPerProcess: without a store's keys, secrets verify in the process
// that issued them only.
func TestPerProcess(t *testing.T) {
	ctx := context.Background()
	a, perProcess := claimsecret.New(nil, time.Now, time.Minute, quiet)
	require.True(t, perProcess)
	b, _ := claimsecret.New(nil, time.Now, time.Minute, quiet)
	issuer, err := a.Issuer(ctx)
	require.NoError(t, err)
	secret := claimsecret.Derive(issuer.Key, k, 9)
	require.NoError(t, a.Check(ctx, k, 9, secret))
	require.ErrorIs(t, a.Check(ctx, k, 10, secret), claimsecret.ErrUnknown, "another token")
	require.ErrorIs(t, b.Check(ctx, k, 9, secret), claimsecret.ErrUnknown, "another process")
}

// TestRotation: on a real store, a secret issued under generation 1 still
// verifies after a rotation while generation 1 is accepted, new secrets
// are issued under generation 2 once it is active, another server on the
// store learns of the rotation when a secret misses, and the page tokens'
// sealer follows the generation.
func TestRotation(t *testing.T) {
	ctx := context.Background()
	store, err := pebble.Open(t.TempDir())
	require.NoError(t, err)
	defer store.Close()
	a, perProcess := claimsecret.New(store, time.Now, time.Hour, quiet)
	require.False(t, perProcess)
	b, _ := claimsecret.New(store, time.Now, time.Hour, quiet)
	first, err := a.Issuer(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, first.Generation)
	_, err = b.Issuer(ctx) // b has read generation 1 only
	require.NoError(t, err)
	old := claimsecret.Derive(first.Key, k, 5)

	_, err = store.RotateClaimKey(ctx, storage.RotateClaimKeyParams{Grace: time.Hour})
	require.NoError(t, err)
	// a reads the keys again on its next miss; an issued secret under the
	// new generation makes b miss and re-read.
	require.NoError(t, a.Check(ctx, k, 5, old), "generation 1 is still accepted")
	require.ErrorIs(t, a.Check(ctx, k, 5, bytes.Repeat([]byte{1}, claimsecret.Size)), claimsecret.ErrUnknown)
	second, err := a.Issuer(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, second.Generation, "a read the rotation on its miss")
	fresh := claimsecret.Derive(second.Key, k, 6)
	require.NoError(t, b.Check(ctx, k, 6, fresh), "b learns of generation 2 when a secret misses")

	sealer, err := b.Sealer(ctx, 1)
	require.NoError(t, err)
	require.NotNil(t, sealer, "generation 1's page tokens still open")
	none, err := b.Sealer(ctx, 7)
	require.NoError(t, err)
	assert.Nil(t, none, "no generation 7")
}

// TestDeriveConcurrentKeys: Derive and Check answer alike however their
// pooled HMACs were keyed before, from goroutines that alternate claim
// keys, against an HMAC built afresh for each secret, as before they were
// pooled.
func TestDeriveConcurrentKeys(t *testing.T) {
	keys := [][]byte{bytes.Repeat([]byte{1}, storage.ClaimKeySize), bytes.Repeat([]byte{2}, storage.ClaimKeySize)}
	fresh := func(key []byte, k storage.Key, token int64) []byte {
		m := hmac.New(sha256.New, key)
		var buf [binary.MaxVarintLen64]byte
		m.Write([]byte("idemreg claim secret v1"))
		m.Write(binary.AppendUvarint(buf[:0], uint64(len(k.Consumer))))
		m.Write([]byte(k.Consumer))
		m.Write([]byte{byte(k.Kind)})
		m.Write(binary.AppendUvarint(buf[:0], uint64(len(k.Key))))
		m.Write([]byte(k.Key))
		m.Write(binary.BigEndian.AppendUint64(buf[:0], uint64(token)))
		return m.Sum(nil)[:claimsecret.Size]
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				key := keys[(g+i)%2]
				k := storage.Key{Consumer: "c" + strconv.Itoa(g), Kind: storage.KindMessage, Key: strconv.Itoa(i)}
				got := claimsecret.Derive(key, k, int64(i))
				if !bytes.Equal(fresh(key, k, int64(i)), got) {
					t.Errorf("goroutine %d, secret %d: %x", g, i, got)
					return
				}
			}
		})
	}
	wg.Wait()
}
