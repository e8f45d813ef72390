package storagetest

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// mixedBatcherCases are the cases of the storage.MixedBatcher capability:
// a batch of Claims and Completes answers item by item what the unary
// calls would have, in order, each item's error its own.
var mixedBatcherCases = []testCase[storage.MixedBatcher]{
	{"AnswersLikeUnaryCalls", testMixedLikeUnary},
	{"CompleteThenClaimOfOneKey", testMixedCompleteThenClaim},
	{"SameKeyTwice", testMixedSameKeyTwice},
	{"StaleCompleteFailsAlone", testMixedStaleCompleteAlone},
	{"RefusedInputFailsAlone", testMixedRefusedInputAlone},
	{"EmptyBatch", func(t *testing.T, _ storage.Store, b storage.MixedBatcher, _ *Clock) {
		require.Empty(t, b.Batch(t.Context(), nil))
	}},
	{"RaceMixedBatchesAndUnaryCalls", testMixedRace},
}

func claimOp(p storage.ClaimParams) storage.Op { return storage.Op{Claim: &p} }

func completeOp(k storage.Key, token int64, result string) storage.Op {
	return storage.Op{Complete: &storage.CompleteParams{Key: k, Token: token, Result: []byte(result)}}
}

// testMixedLikeUnary: one batch holds Claims and Completes over distinct
// keys in each state the unary calls answer; each answer is theirs, and
// what was written is what Lookup reads.
func testMixedLikeUnary(t *testing.T, s storage.Store, b storage.MixedBatcher, _ *Clock) {
	fresh, busy, held, done, missing, other := newKey(storage.KindMessage), newKey(storage.KindOperation),
		newKey(storage.KindOperation), newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindOperation)
	busyRec := acquire(t, s, claimParams(busy, "fp"))
	heldRec := acquire(t, s, claimParams(held, "fp"))
	doneRec := acquire(t, s, claimParams(done, "fp"))
	complete(t, s, done, doneRec.Token, "stored")
	acquire(t, s, claimParams(other, "fp"))

	got := b.Batch(t.Context(), []storage.Op{
		claimOp(claimParams(fresh, "fp")),
		completeOp(held, heldRec.Token, "held-result"),
		claimOp(claimParams(busy, "fp")),
		completeOp(missing, 1, "x"),
		claimOp(claimParams(done, "fp")),
		claimOp(claimParams(other, "another")),
	})
	require.Len(t, got, 6)

	require.NoError(t, got[0].Err)
	require.Equal(t, storage.OutcomeAcquired, got[0].Claim.Outcome)
	require.EqualValues(t, 1, got[0].Claim.Record.Attempt)
	looked, err := s.Lookup(t.Context(), fresh)
	require.NoError(t, err)
	requireSame(t, got[0].Claim.Record, looked)

	require.NoError(t, got[1].Err)
	require.Equal(t, storage.StateCompleted, got[1].Record.State)
	require.Equal(t, "held-result", string(got[1].Record.Result))
	looked, err = s.Lookup(t.Context(), held)
	require.NoError(t, err)
	requireSame(t, got[1].Record, looked)

	require.NoError(t, got[2].Err)
	require.Equal(t, storage.OutcomeInProgress, got[2].Claim.Outcome)
	require.Equal(t, busyRec.Token, got[2].Claim.Record.Token)
	require.Positive(t, got[2].Claim.RetryAfter)

	require.ErrorIs(t, got[3].Err, storage.ErrNotFound)

	require.NoError(t, got[4].Err)
	require.Equal(t, storage.OutcomeCompleted, got[4].Claim.Outcome)
	require.Equal(t, "stored", string(got[4].Claim.Record.Result))

	require.ErrorIs(t, got[5].Err, storage.ErrFingerprintMismatch)
}

// testMixedCompleteThenClaim: a caller's Complete and then Claim of one key
// in one batch keep their order: the Claim replays the result the Complete
// stored. A Claim and then a Complete of a fresh key with a token from
// nowhere: the Claim acquires, the Complete is refused.
func testMixedCompleteThenClaim(t *testing.T, s storage.Store, b storage.MixedBatcher, _ *Clock) {
	k, fresh := newKey(storage.KindOperation), newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, "fp"))
	got := b.Batch(t.Context(), []storage.Op{
		completeOp(k, rec.Token, "done"),
		claimOp(claimParams(fresh, "")),
		claimOp(claimParams(k, "fp")),
		completeOp(fresh, 1, "too early"),
	})
	require.NoError(t, got[0].Err)
	require.Equal(t, "done", string(got[0].Record.Result))
	require.NoError(t, got[2].Err)
	require.Equal(t, storage.OutcomeCompleted, got[2].Claim.Outcome, "the Claim saw the Complete before it")
	require.Equal(t, "done", string(got[2].Claim.Record.Result))
	require.NoError(t, got[1].Err)
	require.Equal(t, storage.OutcomeAcquired, got[1].Claim.Outcome)
	require.ErrorIs(t, got[3].Err, storage.ErrLeaseLost, "the Complete saw the Claim before it")
}

// testMixedSameKeyTwice: the second item of a key sees the first's effect,
// for each kind.
func testMixedSameKeyTwice(t *testing.T, s storage.Store, b storage.MixedBatcher, _ *Clock) {
	k, j := newKey(storage.KindMessage), newKey(storage.KindOperation)
	jRec := acquire(t, s, claimParams(j, ""))
	second := claimParams(k, "fp")
	second.Holder = "holder-b"
	got := b.Batch(t.Context(), []storage.Op{
		claimOp(claimParams(k, "fp")),
		completeOp(j, jRec.Token, "first"),
		claimOp(second),
		completeOp(j, jRec.Token, "second"),
	})
	require.NoError(t, got[0].Err)
	require.Equal(t, storage.OutcomeAcquired, got[0].Claim.Outcome)
	require.NoError(t, got[2].Err)
	require.Equal(t, storage.OutcomeInProgress, got[2].Claim.Outcome)
	require.Equal(t, got[0].Claim.Record.Token, got[2].Claim.Record.Token)
	require.Equal(t, "holder-a", got[2].Claim.Record.Holder)
	require.NoError(t, got[1].Err)
	require.NoError(t, got[3].Err, "repeating a Complete is a success")
	require.Equal(t, "first", string(got[3].Record.Result), "the first result stays")
}

// testMixedStaleCompleteAlone: a Complete with a stale token beside fresh
// Claims fails alone with LEASE_LOST; the others are written.
func testMixedStaleCompleteAlone(t *testing.T, s storage.Store, b storage.MixedBatcher, _ *Clock) {
	taken, a, c := newKey(storage.KindOperation), newKey(storage.KindMessage), newKey(storage.KindMessage)
	rec := acquire(t, s, claimParams(taken, ""))
	got := b.Batch(t.Context(), []storage.Op{
		claimOp(claimParams(a, "")),
		completeOp(taken, rec.Token-1, "stale"),
		claimOp(claimParams(c, "")),
	})
	require.ErrorIs(t, got[1].Err, storage.ErrLeaseLost)
	for _, i := range []int{0, 2} {
		require.NoError(t, got[i].Err)
		require.Equal(t, storage.OutcomeAcquired, got[i].Claim.Outcome)
		looked, err := s.Lookup(t.Context(), got[i].Claim.Record.Key)
		require.NoError(t, err)
		requireSame(t, got[i].Claim.Record, looked)
	}
	looked, err := s.Lookup(t.Context(), taken)
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, looked.State, "the stale item changed nothing")
}

// testMixedRefusedInputAlone: an item whose input a store may refuse (a NUL
// byte in its holder, which PostgreSQL refuses in text) either succeeds or
// fails alone: the others get their normal answers and are written.
func testMixedRefusedInputAlone(t *testing.T, s storage.Store, b storage.MixedBatcher, _ *Clock) {
	held, a, bad, c := newKey(storage.KindOperation), newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindMessage)
	rec := acquire(t, s, claimParams(held, ""))
	badClaim := claimParams(bad, "")
	badClaim.Holder = "bad\x00holder"
	got := b.Batch(t.Context(), []storage.Op{
		claimOp(claimParams(a, "")),
		claimOp(badClaim),
		completeOp(held, rec.Token, "r"),
		claimOp(claimParams(c, "")),
	})
	if got[1].Err != nil {
		_, err := s.Lookup(t.Context(), bad)
		require.ErrorIs(t, err, storage.ErrNotFound, "a refused item wrote nothing")
	}
	for _, i := range []int{0, 3} {
		require.NoError(t, got[i].Err)
		require.Equal(t, storage.OutcomeAcquired, got[i].Claim.Outcome)
	}
	require.NoError(t, got[2].Err)
	looked, err := s.Lookup(t.Context(), held)
	require.NoError(t, err)
	require.Equal(t, "r", string(looked.Result))
}

// testMixedRace: goroutines send mixed batches and unary calls over a few
// keys while the clock moves past leases (so keys are taken over). Every
// Complete they send with a stale token (one below a token they were
// given) is refused; no two Claims acquire one key with one token; the
// tokens each goroutine sees for a key never go down; and of a key's
// accepted Completes, all carry the one token its record was completed
// with.
func testMixedRace(t *testing.T, s storage.Store, b storage.MixedBatcher, c *Clock) {
	keys := make([]storage.Key, 6)
	for i := range keys {
		keys[i] = newKey(storage.KindOperation)
	}
	const workers, rounds = 8, 25
	var (
		mu        sync.Mutex
		acquired  = map[storage.Key]map[int64]string{}
		completed = map[storage.Key]map[int64]bool{}
		wg        sync.WaitGroup
		stop      = make(chan struct{})
	)
	wg.Go(func() { // leases run out now and then; records never expire
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for moved := time.Duration(0); moved < retention/2; moved += lease / 2 {
			select {
			case <-stop:
				return
			case <-tick.C:
				c.Advance(lease / 2)
			}
		}
	})
	var workersWG sync.WaitGroup
	for w := range workers {
		workersWG.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 36))
			holder := fmt.Sprintf("worker-%d", w)
			seen := map[storage.Key]int64{} // the highest token seen per key
			held := map[storage.Key]int64{} // tokens this worker acquired, not completed
			observe := func(k storage.Key, token int64) {
				require.GreaterOrEqual(t, token, seen[k], "%s: tokens of %s went down", holder, k.Key)
				seen[k] = token
			}
			for r := range rounds {
				var ops []storage.Op
				for range 1 + rng.IntN(3) {
					p := claimParams(keys[rng.IntN(len(keys))], "")
					p.Holder = holder
					ops = append(ops, claimOp(p))
				}
				for k, token := range held {
					ops = append(ops, completeOp(k, token, fmt.Sprintf("%s-%d", holder, token)))
					if rng.IntN(2) == 0 {
						ops = append(ops, completeOp(k, token-1, "stale"))
					}
					delete(held, k)
				}
				rng.Shuffle(len(ops), func(i, j int) { ops[i], ops[j] = ops[j], ops[i] })
				var answers []storage.OpAnswer
				if r%2 == 0 {
					answers = b.Batch(t.Context(), ops)
				} else {
					answers = make([]storage.OpAnswer, len(ops))
					for i, op := range ops {
						if op.Claim != nil {
							answers[i].Claim, answers[i].Err = s.Claim(t.Context(), *op.Claim)
						} else {
							answers[i].Record, answers[i].Err = s.Complete(t.Context(), *op.Complete)
						}
					}
				}
				for i, op := range ops {
					a := answers[i]
					if p := op.Claim; p != nil {
						require.NoError(t, a.Err, "claim of %s", p.Key.Key)
						observe(p.Key, a.Claim.Record.Token)
						if a.Claim.Outcome == storage.OutcomeAcquired {
							mu.Lock()
							if acquired[p.Key] == nil {
								acquired[p.Key] = map[int64]string{}
							}
							prev, dup := acquired[p.Key][a.Claim.Record.Token]
							acquired[p.Key][a.Claim.Record.Token] = holder
							mu.Unlock()
							require.False(t, dup, "%s acquired %s with token %d, as %s did", holder, p.Key.Key, a.Claim.Record.Token, prev)
							held[p.Key] = a.Claim.Record.Token
						}
						continue
					}
					p := op.Complete
					if string(p.Result) == "stale" {
						require.Error(t, a.Err, "a Complete with a stale token was accepted")
						continue
					}
					if a.Err != nil {
						require.ErrorIs(t, a.Err, storage.ErrLeaseLost, "complete of %s", p.Key.Key)
						continue
					}
					observe(p.Key, a.Record.Token)
					mu.Lock()
					if completed[p.Key] == nil {
						completed[p.Key] = map[int64]bool{}
					}
					completed[p.Key][p.Token] = true
					mu.Unlock()
				}
			}
		})
	}
	workersWG.Wait()
	close(stop)
	wg.Wait()
	for _, k := range keys {
		require.LessOrEqual(t, len(completed[k]), 1, "%s: Completes accepted with tokens %v", k.Key, completed[k])
		for token := range completed[k] {
			rec, err := s.Lookup(t.Context(), k)
			if err != nil {
				require.ErrorIs(t, err, storage.ErrNotFound) // expired since
				continue
			}
			require.Equal(t, storage.StateCompleted, rec.State)
			require.Equal(t, token, rec.Token)
			require.Equal(t, acquired[k][token]+fmt.Sprintf("-%d", token), string(rec.Result))
		}
	}
}
