package pebble

import (
	"context"
	"time"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Admin = (*Store)(nil)

// Inspect returns the stored record, expired or not, under the key's lock.
func (s *Store) Inspect(ctx context.Context, k storage.Key) (res storage.InspectResult, err error) {
	err = s.withRecord(ctx, k, func(_ []byte, cur *storage.Record) error {
		if cur == nil {
			return storage.ErrNotFound
		}
		res = storage.InspectResult{Record: *cur, Now: s.clock()}
		return nil
	})
	return res, err
}

// Invalidate decides by storage.DecideInvalidate under the key's lock. The
// record stays, so the token floor it carries stays with it.
func (s *Store) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideInvalidate(now, cur, p)
	})
}
