package pebble

import (
	"context"
	"time"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Admin = (*Store)(nil)

// Inspect returns the stored record, expired or not, under the key's lock.
func (s *Store) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	if err := s.begin(ctx); err != nil {
		return storage.InspectResult{}, err
	}
	defer s.end()
	key := recordKeyOf(k)
	defer s.lockKey(key).Unlock()

	var stored storage.Record
	found, err := s.read(key, &stored)
	if err != nil {
		return storage.InspectResult{}, err
	}
	if !found {
		return storage.InspectResult{}, storage.ErrNotFound
	}
	stored.Key = k
	return storage.InspectResult{Record: stored, Now: s.clock()}, nil
}

// Invalidate decides by storage.DecideInvalidate under the key's lock. The
// record stays, so the token floor it carries stays with it.
func (s *Store) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideInvalidate(now, cur, p)
	})
}
