package peers

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/storage"
)

// ring is a claim key ring of fixed generations.
type ring struct {
	current int64
	keys    map[int64][]byte
}

func (r ring) Current(context.Context) (int64, []byte, error) {
	return r.current, r.keys[r.current], nil
}

func (r ring) Generation(_ context.Context, gen int64) ([]byte, bool, error) {
	k, ok := r.keys[gen]
	return k, ok, nil
}

func key(b byte) []byte {
	k := make([]byte, storage.ClaimKeySize)
	for i := range k {
		k[i] = b
	}
	return k
}

// TestWake: a message sealed under an accepted generation wakes the keys
// it names on the replica it is meant for; one sealed under another
// store's key, tampered with, or meant for another replica wakes none.
func TestWake(t *testing.T) {
	ours := ring{current: 2, keys: map[int64][]byte{1: key(1), 2: key(2)}}
	var woken []storage.Key
	r := NewReceiver("b", ours, func(k storage.Key) { woken = append(woken, k) })
	k := storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}
	var seq int64
	sealWith := func(keys Keys, to string) []byte {
		seq++
		m := message{From: "a", To: to, Seq: time.Now().UnixNano() + seq, Keys: []wireKey{{Consumer: k.Consumer, Kind: uint8(k.Kind), Key: k.Key}}}
		b, err := (&sealers{keys: keys}).seal(t.Context(), m)
		require.NoError(t, err)
		return b
	}

	_, err := r.Wake(t.Context(), wrapperspb.Bytes(sealWith(ours, "b")))
	require.NoError(t, err)
	require.Equal(t, []storage.Key{k}, woken)

	// A replica still on generation 1 (not yet read the rotation).
	woken = nil
	_, err = r.Wake(t.Context(), wrapperspb.Bytes(sealWith(ring{current: 1, keys: ours.keys}, "b")))
	require.NoError(t, err)
	require.Equal(t, []storage.Key{k}, woken)

	woken = nil
	_, err = r.Wake(t.Context(), wrapperspb.Bytes(sealWith(ours, "a restarted b")))
	require.NoError(t, err)
	require.Empty(t, woken, "meant for another replica")

	for name, msg := range map[string][]byte{
		"another store":  sealWith(ring{current: 2, keys: map[int64][]byte{2: key(9)}}, "b"),
		"unknown gen":    sealWith(ring{current: 7, keys: map[int64][]byte{7: key(2)}}, "b"),
		"tampered":       func() []byte { b := sealWith(ours, "b"); b[len(b)-1] ^= 1; return b }(),
		"short":          {0, 0, 0},
		"empty":          nil,
		"just the nonce": sealWith(ours, "b")[:20],
	} {
		_, err := r.Wake(t.Context(), wrapperspb.Bytes(msg))
		require.Equal(t, codes.Unauthenticated, status.Code(err), name)
	}
	require.Empty(t, woken)
}
