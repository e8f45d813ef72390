package postgres

import (
	"context"
	"crypto/rand"
	"fmt"

	"github.com/idemreg/idemreg/storage"
)

// claimKeySQL inserts the candidate key unless a key exists and returns the
// stored one. The no-op update makes RETURNING give the existing row, and
// a concurrent first insert is waited for, so every server gets one key.
const claimKeySQL = `
INSERT INTO idemreg_secrets (name, value) VALUES ('claim', $1)
ON CONFLICT (name) DO UPDATE SET value = idemreg_secrets.value
RETURNING value`

// ClaimKey implements storage.ClaimKeys.
func (s *Store) ClaimKey(ctx context.Context) ([]byte, error) {
	candidate := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(candidate) // never fails (crypto/rand)
	var key []byte
	err := s.run(ctx, "claim key", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, claimKeySQL, candidate).Scan(&key)
	})
	if err != nil {
		return nil, err
	}
	if len(key) != storage.ClaimKeySize {
		return nil, fmt.Errorf("%w: postgres: the stored claim key has %d bytes, not %d", storage.ErrUnavailable, len(key), storage.ClaimKeySize)
	}
	return key, nil
}
