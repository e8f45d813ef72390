package pebble

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// ClaimKeyRing implements storage.ClaimKeys: generation 1 is created,
// synced, on the first call (from metaClaimKey, the key of directories
// written before keys had generations) and the keys are read from the data
// directory after that.
func (s *Store) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	if err := s.begin(ctx); err != nil {
		return storage.ClaimKeyRing{}, err
	}
	defer s.end()
	s.keyMu.Lock()
	defer s.keyMu.Unlock()
	keys, err := s.claimKeys()
	if err != nil {
		return storage.ClaimKeyRing{}, err
	}
	now := s.clock()
	return ringAt(keys, now), nil
}

// RotateClaimKey implements storage.ClaimKeys.
func (s *Store) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	if p.ActivateAfter < 0 || p.Grace < 0 {
		return storage.ClaimKeyRing{}, errors.New("pebble: rotate claim key: negative activation delay or grace")
	}
	if err := s.begin(ctx); err != nil {
		return storage.ClaimKeyRing{}, err
	}
	defer s.end()
	s.keyMu.Lock()
	defer s.keyMu.Unlock()
	keys, err := s.claimKeys()
	if err != nil {
		return storage.ClaimKeyRing{}, err
	}
	now := s.clock()
	active := now.Add(p.ActivateAfter)
	next := storage.ClaimKey{Generation: keys[0].Generation + 1, Key: make([]byte, storage.ClaimKeySize), ActiveFrom: active}
	_, _ = rand.Read(next.Key) // never fails (crypto/rand)
	kept := []storage.ClaimKey{next}
	for _, k := range keys {
		if k.AcceptUntil.IsZero() {
			k.AcceptUntil = active.Add(p.Grace)
		}
		if k.Accepted(now) {
			kept = append(kept, k)
		}
	}
	if err := s.set(metaClaimKeys, encodeClaimKeys(kept), "write claim keys"); err != nil {
		return storage.ClaimKeyRing{}, err
	}
	return ringAt(kept, now), nil
}

// claimKeys reads every stored generation, newest first, creating
// generation 1 when there is none. The caller holds keyMu.
func (s *Store) claimKeys() ([]storage.ClaimKey, error) {
	v, closer, err := s.db.Get(metaClaimKeys)
	switch {
	case err == nil:
		keys, derr := decodeClaimKeys(v)
		_ = closer.Close()
		if derr != nil {
			return nil, fmt.Errorf("%w: pebble: the stored claim keys: %w", storage.ErrUnavailable, derr)
		}
		return keys, nil
	case !errors.Is(err, pebble.ErrNotFound):
		return nil, unavailable("read claim keys", err)
	}
	legacy, err := s.legacyClaimKey()
	if err != nil {
		return nil, err
	}
	keys := []storage.ClaimKey{{Generation: 1, Key: legacy, ActiveFrom: s.clock()}}
	if err := s.set(metaClaimKeys, encodeClaimKeys(keys), "write claim keys"); err != nil {
		return nil, err
	}
	return keys, nil
}

// legacyClaimKey reads metaClaimKey, creating it when missing.
func (s *Store) legacyClaimKey() ([]byte, error) {
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
	if err := s.set(metaClaimKey, key, "write claim key"); err != nil {
		return nil, err
	}
	return key, nil
}

// ringAt is the ring of keys as read at now: those still accepted.
func ringAt(keys []storage.ClaimKey, now time.Time) storage.ClaimKeyRing {
	ring := storage.ClaimKeyRing{Now: now}
	for _, k := range keys {
		if k.Accepted(now) {
			ring.Keys = append(ring.Keys, k)
		}
	}
	return ring
}

// encodeClaimKeys lays keys out as a count, then per key its generation,
// the key, and its active_from and accept_until in µs since the epoch (0:
// none), all varints but the key.
func encodeClaimKeys(keys []storage.ClaimKey) []byte {
	b := binary.AppendUvarint(nil, uint64(len(keys)))
	for _, k := range keys {
		b = binary.AppendVarint(b, k.Generation)
		b = append(b, k.Key...)
		b = binary.AppendVarint(b, k.ActiveFrom.UnixMicro())
		var till int64
		if !k.AcceptUntil.IsZero() {
			till = k.AcceptUntil.UnixMicro()
		}
		b = binary.AppendVarint(b, till)
	}
	return b
}

func decodeClaimKeys(b []byte) ([]storage.ClaimKey, error) {
	bad := errors.New("malformed")
	n, used := binary.Uvarint(b)
	if used <= 0 || n == 0 || n > uint64(len(b)) {
		return nil, bad
	}
	b = b[used:]
	varint := func() (int64, bool) {
		v, used := binary.Varint(b)
		if used <= 0 {
			return 0, false
		}
		b = b[used:]
		return v, true
	}
	keys := make([]storage.ClaimKey, 0, n)
	for range n {
		var k storage.ClaimKey
		gen, ok := varint()
		if !ok || len(b) < storage.ClaimKeySize {
			return nil, bad
		}
		k.Generation, k.Key, b = gen, append([]byte(nil), b[:storage.ClaimKeySize]...), b[storage.ClaimKeySize:]
		active, ok1 := varint()
		till, ok2 := varint()
		if !ok1 || !ok2 {
			return nil, bad
		}
		k.ActiveFrom = time.UnixMicro(active).UTC()
		if till != 0 {
			k.AcceptUntil = time.UnixMicro(till).UTC()
		}
		keys = append(keys, k)
	}
	if len(b) != 0 {
		return nil, bad
	}
	return keys, nil
}
