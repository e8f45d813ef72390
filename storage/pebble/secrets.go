package pebble

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// ClaimKey implements storage.ClaimKeys: the key is created, synced, on the
// first call and read from the data directory after that.
func (s *Store) ClaimKey(ctx context.Context) ([]byte, error) {
	if err := s.begin(ctx); err != nil {
		return nil, err
	}
	defer s.end()
	s.keyMu.Lock()
	defer s.keyMu.Unlock()
	v, closer, err := s.db.Get(metaClaimKey)
	switch {
	case err == nil:
		key := append([]byte(nil), v...)
		_ = closer.Close()
		if len(key) != storage.ClaimKeySize {
			return nil, fmt.Errorf("%w: pebble: the stored claim key has %d bytes, not %d", storage.ErrUnavailable, len(key), storage.ClaimKeySize)
		}
		return key, nil
	case !errors.Is(err, pebble.ErrNotFound):
		return nil, unavailable("read claim key", err)
	}
	key := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(key) // never fails (crypto/rand)
	if err := s.db.Set(metaClaimKey, key, pebble.Sync); err != nil {
		return nil, unavailable("write claim key", err)
	}
	return key, nil
}
