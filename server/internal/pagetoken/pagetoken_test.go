package pagetoken_test

import (
	"crypto/rand"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/pagetoken"
	"github.com/idemreg/idemreg/storage"
)

func key(t *testing.T) []byte {
	k := make([]byte, 32)
	_, err := rand.Read(k)
	require.NoError(t, err)
	return k
}

// TestRoundTrip: a token opens to the key it was made after, names its
// generation, and opens only under its own key, its own filters and its
// own range.
func TestRoundTrip(t *testing.T) {
	p := storage.ListParams{Consumer: "billing.", Prefix: true, State: storage.StateParked, MinAttempt: 2}
	f := pagetoken.Digest(p)
	aead := pagetoken.Sealer(key(t))
	after := storage.Key{Consumer: "billing.worker", Kind: storage.KindOperation, Key: "charge-7"}
	tok := pagetoken.Encode(aead, 42, f, after)
	require.LessOrEqual(t, len(tok), pagetoken.MaxBytes)

	gen, ok := pagetoken.Generation(tok)
	require.True(t, ok)
	assert.EqualValues(t, 42, gen)
	got, err := pagetoken.Open(aead, tok, f, p)
	require.NoError(t, err)
	assert.Equal(t, after, got)

	other := p
	other.MinAttempt = 3
	_, err = pagetoken.Open(aead, tok, pagetoken.Digest(other), other)
	assert.ErrorIs(t, err, pagetoken.ErrOtherFilters, "other filters")
	_, err = pagetoken.Open(pagetoken.Sealer(key(t)), tok, f, p)
	assert.ErrorIs(t, err, pagetoken.ErrGarbled, "another claim key")
	narrower := storage.ListParams{Consumer: "billing.other", State: p.State, MinAttempt: p.MinAttempt}
	_, err = pagetoken.Open(aead, pagetoken.Encode(aead, 42, pagetoken.Digest(narrower), after), pagetoken.Digest(narrower), narrower)
	assert.ErrorIs(t, err, pagetoken.ErrGarbled, "a key outside the listing's consumer")
}

// TestTampered: every byte flipped, and garbage, is refused as garbled or
// as of other filters, never opened.
func TestTampered(t *testing.T) {
	p := storage.ListParams{Consumer: "c"}
	f := pagetoken.Digest(p)
	aead := pagetoken.Sealer(key(t))
	tok := pagetoken.Encode(aead, 1, f, storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"})
	for i := range tok {
		b := []byte(tok)
		b[i] = "AB"[0+boolInt(b[i] == 'A')]
		if _, err := pagetoken.Open(aead, string(b), f, p); err == nil {
			t.Fatalf("byte %d changed: the token still opens", i)
		}
	}
	for _, garbage := range []string{"", "!", "AAAA", strings.Repeat("A", 200)} {
		_, err := pagetoken.Open(aead, garbage, f, p)
		assert.Error(t, err, "%q", garbage)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
