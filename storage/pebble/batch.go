package pebble

import (
	"context"
	"slices"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// ClaimBatch implements storage.Batcher: every item decided under its key's
// lock, and all the writes in one synced batch.
func (s *Store) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	out := make([]storage.ClaimAnswer, len(ps))
	err := s.decideMany(ctx, len(ps), func(i int) storage.Key { return ps[i].Key },
		func(i int, now time.Time, cur *storage.Record) (*storage.Record, error) {
			if cur == nil {
				if floor := s.floor.Load(); floor > 0 {
					// As in Claim: the key may have had a record the
					// sweeper deleted.
					cur = &storage.Record{Key: ps[i].Key, Token: floor}
				}
			}
			res, write, err := storage.DecideClaim(now, cur, ps[i])
			if err == nil && write && res.Outcome == storage.OutcomeAcquired {
				// As in Claim: no new attempt below the reserve.
				if err = s.disk.refuseAttempt(); err != nil {
					res, write = storage.ClaimResult{}, false
				}
			}
			out[i] = storage.ClaimAnswer{Result: res, Err: err}
			if err != nil || !write {
				return nil, nil
			}
			normalize(&out[i].Result.Record)
			return &out[i].Result.Record, nil
		})
	for i := range out {
		if err != nil {
			out[i] = storage.ClaimAnswer{Err: err}
		}
		// Only Inspect and List return History.
		out[i].Result.Record.History = nil
	}
	return out
}

// CompleteBatch implements storage.Batcher like ClaimBatch.
func (s *Store) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	out := make([]storage.CompleteAnswer, len(ps))
	err := s.decideMany(ctx, len(ps), func(i int) storage.Key { return ps[i].Key },
		func(i int, now time.Time, cur *storage.Record) (*storage.Record, error) {
			rec, write, err := storage.DecideComplete(now, cur, ps[i])
			if err == nil && write {
				if err = s.disk.refuseResult(len(ps[i].Result)); err != nil {
					rec, write = storage.Record{}, false
				}
			}
			out[i] = storage.CompleteAnswer{Record: rec, Err: err}
			if err != nil || !write {
				return nil, nil
			}
			normalize(&out[i].Record)
			return &out[i].Record, nil
		})
	for i := range out {
		if err != nil {
			out[i] = storage.CompleteAnswer{Err: err}
		}
		out[i].Record.History = nil
	}
	return out
}

// decideMany decides n items in order under the locks of all their keys,
// at one clock reading. decide gets the item's current record (nil when
// there is none), as the items before it left it, and returns the record
// to write, or nil. Every write goes into one batch synced once, before
// any answer is given; when that fails, the error is every item's answer.
func (s *Store) decideMany(ctx context.Context, n int, keyOf func(int) storage.Key,
	decide func(i int, now time.Time, cur *storage.Record) (*storage.Record, error),
) error {
	if err := s.begin(ctx); err != nil {
		return err
	}
	defer s.end()
	keys := make([][]byte, n)
	stripes := make([]int, 0, n)
	for i := range n {
		keys[i] = recordKeyOf(keyOf(i))
		stripes = append(stripes, s.stripe(keys[i]))
	}
	// In stripe order, as no two batches then wait for each other.
	slices.Sort(stripes)
	stripes = slices.Compact(stripes)
	for _, st := range stripes {
		s.locks[st].Lock()
	}
	defer func() {
		for _, st := range stripes {
			s.locks[st].Unlock()
		}
	}()

	type state struct {
		rec *storage.Record // the key's record after the items so far; nil: none
	}
	current := make(map[string]*state, n)
	b := s.db.NewBatch()
	defer b.Close()
	writes := 0
	now := s.clock()
	for i := range n {
		st, ok := current[string(keys[i])]
		if !ok {
			st = &state{}
			var rec storage.Record
			found, err := s.read(keys[i], &rec)
			if err != nil {
				return err
			}
			if found {
				rec.Key = keyOf(i)
				st.rec = &rec
			}
			current[string(keys[i])] = st
		}
		var cur *storage.Record
		if st.rec != nil {
			c := *st.rec // decide may not keep it
			cur = &c
		}
		next, err := decide(i, now, cur)
		if err != nil {
			return err
		}
		if next == nil {
			continue
		}
		if err := addWrite(b, keys[i], st.rec, next); err != nil {
			return err
		}
		written := *next
		st.rec = &written
		writes++
	}
	if writes == 0 {
		return nil
	}
	return s.commit(b, pebble.Sync)
}
