package storagetest

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// batcherCases are the cases of the storage.Batcher capability: a batch
// answers item by item what the single calls would have, in order.
var batcherCases = []testCase[storage.Batcher]{
	{"ClaimBatchAnswersLikeClaim", testClaimBatchLikeClaim},
	{"ClaimBatchSameKeyTwice", testClaimBatchSameKey},
	{"ClaimBatchParks", testClaimBatchParks},
	{"CompleteBatchAnswersLikeComplete", testCompleteBatchLikeComplete},
	{"CompleteBatchSameKeyTwice", testCompleteBatchSameKey},
	{"BatchOfManyNewKeys", testBatchManyNewKeys},
	{"EmptyBatch", testEmptyBatch},
	{"RaceBatchesAndSingleCalls", testRaceBatches},
}

// testClaimBatchLikeClaim: one batch holds a Claim for each row of the
// Claim table that needs no clock movement; each answer is what Claim
// answers for that row, and what was written is what Lookup reads.
func testClaimBatchLikeClaim(t *testing.T, s storage.Store, b storage.Batcher, c *Clock) {
	fresh, busy, done, other, expired := newKey(storage.KindMessage), newKey(storage.KindOperation),
		newKey(storage.KindMessage), newKey(storage.KindOperation), newKey(storage.KindMessage)
	short := claimParams(expired, "fp")
	short.Lease, short.Retention = time.Second, time.Second
	acquire(t, s, short)
	c.Advance(3 * time.Second) // expired is past its retention
	busyRec := acquire(t, s, claimParams(busy, "fp"))
	doneRec := acquire(t, s, claimParams(done, "fp"))
	complete(t, s, done, doneRec.Token, "stored")
	acquire(t, s, claimParams(other, "fp"))

	ps := []storage.ClaimParams{
		claimParams(fresh, "fp"),
		claimParams(busy, "fp"),
		claimParams(done, "fp"),
		claimParams(other, "another"),
		claimParams(expired, "fp"),
	}
	got := b.ClaimBatch(t.Context(), ps)
	require.Len(t, got, len(ps))

	require.NoError(t, got[0].Err)
	require.Equal(t, storage.OutcomeAcquired, got[0].Result.Outcome)
	require.EqualValues(t, 1, got[0].Result.Record.Attempt)
	looked, err := s.Lookup(t.Context(), fresh)
	require.NoError(t, err)
	requireSame(t, got[0].Result.Record, looked)

	require.NoError(t, got[1].Err)
	require.Equal(t, storage.OutcomeInProgress, got[1].Result.Outcome)
	require.Equal(t, busyRec.Token, got[1].Result.Record.Token)
	require.Positive(t, got[1].Result.RetryAfter)

	require.NoError(t, got[2].Err)
	require.Equal(t, storage.OutcomeCompleted, got[2].Result.Outcome)
	require.Equal(t, "stored", string(got[2].Result.Record.Result))

	require.ErrorIs(t, got[3].Err, storage.ErrFingerprintMismatch, "one bad item")

	require.NoError(t, got[4].Err)
	require.Equal(t, storage.OutcomeAcquired, got[4].Result.Outcome, "an expired record is claimed anew")
	require.EqualValues(t, 1, got[4].Result.Record.Attempt)
}

// testClaimBatchSameKey: the second Claim of a key in one batch sees the
// first's effect.
func testClaimBatchSameKey(t *testing.T, s storage.Store, b storage.Batcher, _ *Clock) {
	k := newKey(storage.KindMessage)
	first, second := claimParams(k, "fp"), claimParams(k, "fp")
	second.Holder = "holder-b"
	third := claimParams(k, "other")
	got := b.ClaimBatch(t.Context(), []storage.ClaimParams{first, second, third})
	require.NoError(t, got[0].Err)
	require.Equal(t, storage.OutcomeAcquired, got[0].Result.Outcome)
	require.NoError(t, got[1].Err)
	require.Equal(t, storage.OutcomeInProgress, got[1].Result.Outcome)
	require.Equal(t, got[0].Result.Record.Token, got[1].Result.Record.Token)
	require.Equal(t, "holder-a", got[1].Result.Record.Holder)
	require.ErrorIs(t, got[2].Err, storage.ErrFingerprintMismatch)
}

// testCompleteBatchLikeComplete: good items are stored, bad ones get their
// own errors.
func testCompleteBatchLikeComplete(t *testing.T, s storage.Store, b storage.Batcher, _ *Clock) {
	a, bk, missing, taken := newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindOperation)
	ra := acquire(t, s, claimParams(a, ""))
	rb := acquire(t, s, claimParams(bk, ""))
	rt := acquire(t, s, claimParams(taken, ""))
	got := b.CompleteBatch(t.Context(), []storage.CompleteParams{
		{Key: a, Token: ra.Token, Result: []byte("ra")},
		{Key: missing, Token: 1, Result: []byte("x")},
		{Key: taken, Token: rt.Token - 1, Result: []byte("stale")},
		{Key: bk, Token: rb.Token, Result: []byte("rb")},
	})
	require.NoError(t, got[0].Err)
	require.Equal(t, storage.StateCompleted, got[0].Record.State)
	require.Equal(t, "ra", string(got[0].Record.Result))
	require.ErrorIs(t, got[1].Err, storage.ErrNotFound)
	require.ErrorIs(t, got[2].Err, storage.ErrLeaseLost)
	require.NoError(t, got[3].Err)
	require.Equal(t, "rb", string(got[3].Record.Result))
	for k, want := range map[storage.Key]string{a: "ra", bk: "rb"} {
		rec, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, want, string(rec.Result))
	}
	rec, err := s.Lookup(t.Context(), taken)
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, rec.State, "the stale item changed nothing")
}

// testCompleteBatchSameKey: the first result stays.
func testCompleteBatchSameKey(t *testing.T, s storage.Store, b storage.Batcher, _ *Clock) {
	k := newKey(storage.KindOperation)
	r := acquire(t, s, claimParams(k, ""))
	got := b.CompleteBatch(t.Context(), []storage.CompleteParams{
		{Key: k, Token: r.Token, Result: []byte("first")},
		{Key: k, Token: r.Token, Result: []byte("second")},
	})
	require.NoError(t, got[0].Err)
	require.NoError(t, got[1].Err, "repeating a Complete is a success")
	require.Equal(t, "first", string(got[1].Record.Result))
	require.True(t, got[0].Record.CompletedAt.Equal(got[1].Record.CompletedAt))
}

func testBatchManyNewKeys(t *testing.T, s storage.Store, b storage.Batcher, _ *Clock) {
	const n = 300
	ps := make([]storage.ClaimParams, n)
	for i := range ps {
		ps[i] = claimParams(newKey(storage.KindMessage), "")
	}
	got := b.ClaimBatch(t.Context(), ps)
	cs := make([]storage.CompleteParams, n)
	for i, a := range got {
		require.NoError(t, a.Err)
		require.Equal(t, storage.OutcomeAcquired, a.Result.Outcome)
		require.Equal(t, ps[i].Key, a.Result.Record.Key, "answers are in order")
		cs[i] = storage.CompleteParams{Key: ps[i].Key, Token: a.Result.Record.Token, Result: fmt.Appendf(nil, "r%d", i)}
	}
	for i, a := range b.CompleteBatch(t.Context(), cs) {
		require.NoError(t, a.Err)
		require.Equal(t, fmt.Sprintf("r%d", i), string(a.Record.Result))
	}
}

func testEmptyBatch(t *testing.T, _ storage.Store, b storage.Batcher, _ *Clock) {
	require.Empty(t, b.ClaimBatch(t.Context(), nil))
	require.Empty(t, b.CompleteBatch(t.Context(), nil))
}

// testRaceBatches: batches and single Claims race for the same keys;
// exactly one caller acquires each key, and everyone else sees its holder.
func testRaceBatches(t *testing.T, s storage.Store, b storage.Batcher, _ *Clock) {
	keys := make([]storage.Key, 16)
	for i := range keys {
		keys[i] = newKey(storage.KindMessage)
	}
	const callers = 8
	var (
		mu      sync.Mutex
		winners = map[storage.Key][]string{}
		wg      sync.WaitGroup
	)
	record := func(k storage.Key, holder string, res storage.ClaimResult, err error) {
		require.NoError(t, err)
		if res.Outcome == storage.OutcomeAcquired {
			mu.Lock()
			winners[k] = append(winners[k], holder)
			mu.Unlock()
		}
	}
	for c := range callers {
		wg.Go(func() {
			holder := fmt.Sprintf("batch-%d", c)
			ps := make([]storage.ClaimParams, len(keys))
			for i, k := range keys {
				ps[(i+c)%len(keys)] = claimParams(k, "")
				ps[(i+c)%len(keys)].Holder = holder
			}
			for i, a := range b.ClaimBatch(t.Context(), ps) {
				record(ps[i].Key, holder, a.Result, a.Err)
			}
		})
		wg.Go(func() {
			holder := fmt.Sprintf("single-%d", c)
			for _, k := range keys {
				p := claimParams(k, "")
				p.Holder = holder
				res, err := s.Claim(t.Context(), p)
				record(k, holder, res, err)
			}
		})
	}
	wg.Wait()
	for _, k := range keys {
		require.Len(t, winners[k], 1, "key %s: %v", k.Key, winners[k])
		rec, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, winners[k][0], rec.Holder)
	}
}

// testClaimBatchParks: a batch parks a record whose attempts ran out, as
// Claim does, and a later item of the key answers parked.
func testClaimBatchParks(t *testing.T, s storage.Store, b storage.Batcher, c *Clock) {
	spent, spare := newKey(storage.KindOperation), newKey(storage.KindOperation)
	first := acquire(t, s, atMost(claimParams(spent, "fp"), 1))
	acquire(t, s, atMost(claimParams(spare, "fp"), 2))
	c.Advance(lease + time.Second)
	got := b.ClaimBatch(t.Context(), []storage.ClaimParams{
		atMost(claimParams(spent, "fp"), 1), atMost(claimParams(spare, "fp"), 2), atMost(claimParams(spent, "fp"), 1),
	})
	parked := requireParked(t, got[0].Result, got[0].Err)
	require.Equal(t, first.Token, parked.Token)
	require.Equal(t, storage.ParkReasonMaxAttempts, parked.ParkReason)
	require.NoError(t, got[1].Err)
	require.Equal(t, storage.OutcomeAcquired, got[1].Result.Outcome)
	require.EqualValues(t, 2, got[1].Result.Record.Attempt)
	requireSame(t, parked, requireParked(t, got[2].Result, got[2].Err))
	looked, err := s.Lookup(t.Context(), spent)
	require.NoError(t, err)
	requireSame(t, parked, looked)
}
