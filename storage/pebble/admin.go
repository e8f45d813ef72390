package pebble

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Admin = (*Store)(nil)

// Inspect returns the stored record, expired or not, with its History,
// under the key's lock.
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

// Resolve decides by storage.DecideResolve under the key's lock.
func (s *Store) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideResolve(now, cur, p)
	})
}

// listCheckEvery is how many index entries a scan reads between looks at
// its context.
const listCheckEvery = 256

// List serves a page in two steps. The scan walks the index range in a
// snapshot, reading at most storage.ListScanLimit(p.Limit) entries, and
// picks the records that match. Each picked record is then read again under
// its key's lock, as every record an answer shows is (lockKey), and kept if
// it still matches at the page's clock reading: a record that matches
// throughout is listed, one that changed in between is judged as it is now.
// Next comes from the scan alone, so paging by key holds either way.
func (s *Store) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	if p.Limit <= 0 {
		return storage.ListResult{}, fmt.Errorf("pebble: list limit %d is not positive", p.Limit)
	}
	if err := s.begin(ctx); err != nil {
		return storage.ListResult{}, err
	}
	defer s.end()
	now := s.clock()
	picked, next, err := s.listScan(ctx, now, p)
	if err != nil {
		return storage.ListResult{}, err
	}
	res := storage.ListResult{Next: next, Now: now}
	for _, key := range picked {
		k, err := decodeRecordKey(key)
		if err != nil {
			return storage.ListResult{}, unavailable("list", err)
		}
		rec := storage.Record{Key: k}
		m := s.lockKey(key)
		found, err := s.readWith(s.db, key, &rec, decodeRecordMeta)
		m.Unlock()
		if err != nil {
			return storage.ListResult{}, err
		}
		if found && p.Matches(now, &rec) {
			res.Records = append(res.Records, rec)
		}
	}
	return res, nil
}

// listScan returns the record keys of the records in p's range that match
// at now, at most p.Limit, and where the next page starts (nil: the range
// is over). A listing of parked records walks the parked index, skipping
// expired entries by the expiry the index keeps, and reads the records it
// does not skip; any other walks the record keys and their values.
func (s *Store) listScan(ctx context.Context, now time.Time, p storage.ListParams) (picked [][]byte, next *storage.Key, err error) {
	parked := p.State == storage.StateParked
	lower := consumerPrefix(p.Consumer, p.Prefix)
	if parked {
		lower = appendParkedKey(nil, lower)
	}
	upper := prefixEnd(lower)
	if p.After != nil {
		after := recordKeyOf(*p.After)
		if parked {
			after = appendParkedKey(nil, after)
		}
		// The least key greater than After: nothing sorts between a key
		// and that key followed by 0x00.
		if after = append(after, 0); bytes.Compare(after, lower) > 0 {
			lower = after
		}
	}
	if bytes.Compare(lower, upper) >= 0 {
		return nil, nil, nil
	}

	snap := s.db.NewSnapshot()
	defer func() { _ = snap.Close() }()
	it, err := snap.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: upper})
	if err != nil {
		return nil, nil, unavailable("iterate records", err)
	}
	defer func() {
		if cerr := it.Close(); cerr != nil && err == nil {
			err = unavailable("iterate records", cerr)
		}
	}()

	scanLimit := storage.ListScanLimit(p.Limit)
	var (
		rec  storage.Record
		last []byte // the record key the next page starts after
	)
	for ok, read := it.First(), 1; ok; ok, read = it.Next(), read+1 {
		if read%listCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return nil, nil, unavailable("list", err)
			}
		}
		key := it.Key()
		v, err := it.ValueAndErr()
		if err != nil {
			return nil, nil, unavailable("iterate records", err)
		}
		match := false
		if parked {
			key = key[1:]
			exp, err := decodeParkedValue(v)
			if err != nil {
				return nil, nil, unavailable("list", err)
			}
			if now.Before(exp) {
				found, err := s.readWith(snap, key, &rec, decodeRecordMeta)
				if err != nil {
					return nil, nil, err
				}
				match = found && p.Matches(now, &rec)
			}
		} else {
			if err := decodeRecordMeta(v, &rec); err != nil {
				s.log.Error("undecodable record", "key", fmt.Sprintf("%x", key), "err", err)
				return nil, nil, unavailable("decode record", err)
			}
			match = p.Matches(now, &rec)
		}
		if match {
			picked = append(picked, bytes.Clone(key))
		}
		if len(picked) == p.Limit || read == scanLimit {
			last = key
			break
		}
	}
	if err := it.Error(); err != nil {
		return nil, nil, unavailable("iterate records", err)
	}
	if last != nil {
		k, err := decodeRecordKey(last)
		if err != nil {
			return nil, nil, unavailable("list", err)
		}
		next = &k
	}
	return picked, next, nil
}

// CountParked counts the parked index range of the consumers that start
// with prefix, skipping the entries whose expiry, kept in the index, has
// passed; it reads no record. Like ConsumerUsage it reads without the key
// locks: a park whose WAL sync is still running may already count, which a
// gauge can afford.
func (s *Store) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	if err := s.begin(ctx); err != nil {
		return nil, err
	}
	defer s.end()
	now := s.clock()
	lower := appendParkedKey(nil, consumerPrefix(prefix, true))
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: prefixEnd(lower)})
	if err != nil {
		return nil, unavailable("iterate parked index", err)
	}
	out := map[string]int64{}
	fail := func(err error) (map[string]int64, error) {
		_ = it.Close()
		return nil, unavailable("count parked", err)
	}
	var consumer []byte // the escaped consumer and terminator of the last entry
	var name string
	for ok, read := it.First(), 1; ok; ok, read = it.Next(), read+1 {
		if read%listCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return fail(err)
			}
		}
		v, err := it.ValueAndErr()
		if err != nil {
			return fail(err)
		}
		exp, err := decodeParkedValue(v)
		if err != nil {
			return fail(err)
		}
		if !now.Before(exp) {
			continue
		}
		key := it.Key()[1:]
		if consumer == nil || !bytes.HasPrefix(key, consumer) {
			// Entries come grouped by consumer: decode a name once per
			// group, not once per entry.
			k, err := decodeRecordKey(key)
			if err != nil {
				return fail(err)
			}
			name = k.Consumer
			consumer = consumerPrefix(name, false)
		}
		out[name]++
	}
	if err := it.Close(); err != nil {
		return nil, unavailable("iterate parked index", err)
	}
	return out, nil
}
