package pebble

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// Batch implements storage.MixedBatcher: every item decided under its
// key's lock, in order (a key's later items see the earlier ones' effect),
// and all the writes of Claims and Completes alike in one synced batch:
// one commit for the whole batch.
func (s *Store) Batch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	out := make([]storage.OpAnswer, len(ops))
	err := s.decideMany(ctx, len(ops), func(i int) storage.Key { return ops[i].Key() },
		func(i int, now time.Time, cur *storage.Record) (*storage.Record, error) {
			var next *storage.Record
			switch {
			case ops[i].Claim != nil:
				next = s.decideClaim(now, cur, *ops[i].Claim, &out[i])
			case ops[i].Complete != nil:
				next = s.decideComplete(now, cur, *ops[i].Complete, &out[i])
			default:
				out[i].Err = errors.New("pebble batch: an item with neither a Claim nor a Complete")
			}
			return next, nil
		})
	for i := range out {
		if err != nil {
			out[i] = storage.OpAnswer{Err: err}
		}
		// Only Inspect and List return History.
		out[i].Claim.Record.History = nil
		out[i].Record.History = nil
	}
	return out
}

// decideClaim decides one Claim of a batch as Claim does, sets its answer,
// and returns the record to write, or nil.
func (s *Store) decideClaim(now time.Time, cur *storage.Record, p storage.ClaimParams, out *storage.OpAnswer) *storage.Record {
	if cur == nil {
		if floor := s.floor.Load(); floor > 0 {
			// As in Claim: the key may have had a record the sweeper
			// deleted.
			cur = &storage.Record{Key: p.Key, Token: floor}
		}
	}
	res, write, err := storage.DecideClaim(now, cur, p)
	if err == nil && write && res.Outcome == storage.OutcomeAcquired {
		// As in Claim: no new attempt below the reserve.
		if err = s.disk.refuseAttempt(); err != nil {
			res, write = storage.ClaimResult{}, false
		}
	}
	*out = storage.OpAnswer{Claim: res, Err: err}
	if err != nil || !write {
		return nil
	}
	normalize(&out.Claim.Record)
	return &out.Claim.Record
}

// decideComplete decides one Complete of a batch like decideClaim.
func (s *Store) decideComplete(now time.Time, cur *storage.Record, p storage.CompleteParams, out *storage.OpAnswer) *storage.Record {
	rec, write, err := storage.DecideComplete(now, cur, p)
	if err == nil && write {
		if err = s.disk.refuseResult(len(p.Result)); err != nil {
			rec, write = storage.Record{}, false
		}
	}
	*out = storage.OpAnswer{Record: rec, Err: err}
	if err != nil || !write {
		return nil
	}
	normalize(&out.Record)
	return &out.Record
}

// ClaimBatch implements storage.Batcher through Batch.
func (s *Store) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	ops := make([]storage.Op, len(ps))
	for i := range ps {
		ops[i].Claim = &ps[i]
	}
	out := make([]storage.ClaimAnswer, len(ps))
	for i, a := range s.Batch(ctx, ops) {
		out[i] = storage.ClaimAnswer{Result: a.Claim, Err: a.Err}
	}
	return out
}

// CompleteBatch implements storage.Batcher through Batch.
func (s *Store) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	ops := make([]storage.Op, len(ps))
	for i := range ps {
		ops[i].Complete = &ps[i]
	}
	out := make([]storage.CompleteAnswer, len(ps))
	for i, a := range s.Batch(ctx, ops) {
		out[i] = storage.CompleteAnswer{Record: a.Record, Err: a.Err}
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
