package server

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"sync"
	"sync/atomic"

	"github.com/idemreg/idemreg/storage"
)

// Claim secrets.
//
// A fencing token orders the holders of a key; it is not a credential. It
// comes from the store's clock (storage.NextToken), so it can be computed
// from the created_at or lease_expires_at that every Lookup and
// OUTCOME_IN_PROGRESS answer shows, and a completed record shows it
// outright. What proves a claim is its secret: the first ClaimSecretSize
// bytes of HMAC-SHA256 over (consumer, kind, key, token) under the store's
// claim key (storage.ClaimKeys). Only the answer that acquired the token
// carries it (and a repeat of that Claim with its request_id, which is as
// good as the answer itself); Complete, Release and Extend must send it
// back. Nothing is stored per record: every server on the store derives the
// same secret, and a secret is worthless once its token is not current,
// since tokens are never issued twice.

// ClaimSecretSize is the length of a claim secret.
const ClaimSecretSize = 16

// claimSecrets derives and checks claim secrets. The key is read from the
// store on first use, under the first caller's context, and kept.
type claimSecrets struct {
	source storage.ClaimKeys
	key    atomic.Pointer[[]byte] // nil until read; then every call reads it without a lock
	mu     sync.Mutex             // serialises the first reads
}

// newClaimSecrets reads the key from keys, the store's; nil when the store
// keeps none, which gets a random key for this process only: secrets then
// survive neither a restart nor a move to another replica, so such a store
// suits a single process (tests).
func newClaimSecrets(keys storage.ClaimKeys) (c *claimSecrets, perProcess bool) {
	if keys != nil {
		return &claimSecrets{source: keys}, false
	}
	key := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(key) // never fails (crypto/rand)
	c = &claimSecrets{}
	c.key.Store(&key)
	return c, true
}

// load returns the key. Errors: the store's (storage.ErrUnavailable) when
// it cannot be read.
func (c *claimSecrets) load(ctx context.Context) ([]byte, error) {
	if k := c.key.Load(); k != nil {
		return *k, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if k := c.key.Load(); k != nil {
		return *k, nil
	}
	key, err := c.source.ClaimKey(ctx)
	if err != nil {
		return nil, err
	}
	c.key.Store(&key)
	return key, nil
}

// check answers storage.ErrLeaseLost unless got is the secret of token for
// k: to a caller without the secret, the claim is as good as lost, and the
// answer tells it nothing that a wrong token would not.
func (c *claimSecrets) check(ctx context.Context, k storage.Key, token int64, got []byte) error {
	key, err := c.load(ctx)
	if err != nil {
		return err
	}
	if !hmac.Equal(derive(key, k, token), got) {
		return storage.ErrLeaseLost
	}
	return nil
}

func derive(key []byte, k storage.Key, token int64) []byte {
	m := hmac.New(sha256.New, key)
	// Length-prefixed fields: no two keys encode alike.
	var buf [binary.MaxVarintLen64]byte
	m.Write([]byte("idemreg claim secret v1"))
	m.Write(binary.AppendUvarint(buf[:0], uint64(len(k.Consumer))))
	m.Write([]byte(k.Consumer))
	m.Write([]byte{byte(k.Kind)})
	m.Write(binary.AppendUvarint(buf[:0], uint64(len(k.Key))))
	m.Write([]byte(k.Key))
	m.Write(binary.BigEndian.AppendUint64(buf[:0], uint64(token)))
	return m.Sum(nil)[:ClaimSecretSize]
}
