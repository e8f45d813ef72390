package pebble

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// SweepExpired deletes at most limit records whose ExpiresAt has passed,
// oldest expiry first. It walks the expiry index up to the clock reading, so
// it reads only what it may delete, then re-checks each record under its
// key's lock: a record extended or claimed again meanwhile is kept. The
// deletes, their index entries (the expiry index, and the parked index for
// a parked record) and the raised token floor go in one synced batch.
func (s *Store) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	if err := s.begin(ctx); err != nil {
		return storage.SweepResult{}, err
	}
	defer s.end()
	s.sweepMu.Lock()
	defer s.sweepMu.Unlock()

	now := s.clock()
	res := storage.SweepResult{Now: now}
	if limit <= 0 {
		return res, nil
	}
	expired, err := s.expiredEntries(now, limit)
	if err != nil || len(expired) == 0 {
		return res, err
	}
	if s.afterScan != nil {
		s.afterScan()
	}

	// Lock the stripes in ascending order: calls hold one stripe at a time
	// and sweeps run one at a time, so this cannot deadlock.
	held := make([]int, 0, len(expired))
	for _, e := range expired {
		held = append(held, s.stripe(e[expiryHeader:]))
	}
	slices.Sort(held)
	held = slices.Compact(held)
	for _, i := range held {
		s.locks[i].Lock()
	}
	defer func() {
		for _, i := range held {
			s.locks[i].Unlock()
		}
	}()

	b := s.db.NewBatch()
	defer b.Close()
	floor := s.floor.Load()
	for _, entry := range expired {
		key := entry[expiryHeader:]
		var rec storage.Record
		found, err := s.read(key, &rec)
		if err != nil {
			return res, err
		}
		if !found {
			// An entry without its record breaks the index invariant;
			// drop it so it cannot hold up OldestExpiry forever.
			s.log.Warn("expiry index entry without record", "key", fmt.Sprintf("%x", key))
			if err := b.Delete(entry, nil); err != nil {
				return res, unavailable("batch", err)
			}
			continue
		}
		if rec.Live(now) {
			continue
		}
		if err := b.Delete(key, nil); err != nil {
			return res, unavailable("batch", err)
		}
		if err := b.Delete(appendExpiryKey(nil, rec.ExpiresAt, key), nil); err != nil {
			return res, unavailable("batch", err)
		}
		if rec.State == storage.StateParked {
			if err := b.Delete(appendParkedKey(nil, key), nil); err != nil {
				return res, unavailable("batch", err)
			}
		}
		floor = max(floor, rec.Token)
		res.Deleted++
	}
	if b.Empty() {
		return res, nil
	}
	if floor > s.floor.Load() {
		if err := b.Set(metaTokenFloor, binary.BigEndian.AppendUint64(nil, uint64(floor)), nil); err != nil {
			return res, unavailable("batch", err)
		}
		// Raised before the commit and before the key locks drop: the
		// floor is a lower bound, so raising it early is harmless, and a
		// claim of a key deleted here must see it.
		s.floor.Store(floor)
	}
	if err := s.commit(b, pebble.Sync); err != nil {
		return storage.SweepResult{Now: now}, err
	}
	return res, nil
}

// expiredEntries returns up to limit expiry index keys at or before now,
// oldest first.
func (s *Store) expiredEntries(now time.Time, limit int) ([][]byte, error) {
	it, err := s.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixExpiry},
		UpperBound: appendExpiryBound(nil, now.UnixMicro()+1),
	})
	if err != nil {
		return nil, unavailable("iterate expiry index", err)
	}
	var out [][]byte
	for ok := it.First(); ok && len(out) < limit; ok = it.Next() {
		out = append(out, bytes.Clone(it.Key()))
	}
	if err := it.Close(); err != nil {
		return nil, unavailable("iterate expiry index", err)
	}
	return out, nil
}

// OldestExpiry reads the first entry of the expiry index.
func (s *Store) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	if err := s.begin(ctx); err != nil {
		return time.Time{}, time.Time{}, false, err
	}
	defer s.end()
	now = s.clock()
	it, err := s.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixExpiry},
		UpperBound: []byte{prefixExpiry + 1},
	})
	if err != nil {
		return time.Time{}, now, false, unavailable("iterate expiry index", err)
	}
	if it.First() {
		oldest, _, err = decodeExpiryKey(it.Key())
		ok = err == nil
	}
	if cerr := it.Close(); cerr != nil && err == nil {
		err = unavailable("iterate expiry index", cerr)
	}
	if err != nil {
		return time.Time{}, now, false, err
	}
	return oldest, now, ok, nil
}
