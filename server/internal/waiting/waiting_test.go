package waiting_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/waiting"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

func open(t *testing.T) *pebble.Store {
	s, err := pebble.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func params(key string) storage.ClaimParams {
	return storage.ClaimParams{Key: storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: key},
		Lease: time.Minute, Retention: time.Hour, Holder: "h"}
}

// held claims key for another holder and returns its token.
func held(t *testing.T, s storage.Store, key string) int64 {
	res, err := s.Claim(context.Background(), params(key))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record.Token
}

func claimOf(s storage.Store, key, share string, d time.Duration) waiting.Claim {
	p := params(key)
	return waiting.Claim{Key: p.Key, Share: share, End: time.Now().Add(d), Recheck: time.Hour,
		Decide: func(ctx context.Context) (storage.ClaimResult, error) { return s.Claim(ctx, p) },
		Lookup: s.Lookup}
}

// TestNotifyWakes: waiters on a key in progress answer with the holder's
// result as soon as its Complete is notified, not at the end of the wait
// or at a re-check.
func TestNotifyWakes(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(100, 100)
	token := held(t, s, "k")
	const n = 20
	type answer struct {
		res storage.ClaimResult
		o   waiting.Outcome
	}
	answers := make(chan answer, n)
	for range n {
		go func() {
			res, err, o := h.Claim(context.Background(), claimOf(s, "k", "tenant", time.Minute))
			assert.NoError(t, err)
			answers <- answer{res, o}
		}()
	}
	require.Eventually(t, func() bool { return h.Waiting() == n }, 10*time.Second, time.Millisecond)
	_, err := s.Complete(context.Background(), storage.CompleteParams{Key: params("k").Key, Token: token, Result: []byte("r")})
	require.NoError(t, err)
	start := time.Now()
	h.Notify(params("k").Key)
	for range n {
		a := <-answers
		assert.Equal(t, storage.OutcomeCompleted, a.res.Outcome)
		assert.Equal(t, waiting.Completed, a.o.Ended)
		assert.Equal(t, []byte("r"), a.res.Record.Result)
	}
	assert.Less(t, time.Since(start), 5*time.Second)
	assert.Zero(t, h.Waiting())
}

// TestBounds: beyond the replica's waiters, or the identity's share, a
// Claim answers at once with the bound that refused it; a caller with no
// share (empty) counts only against the replica's bound.
func TestBounds(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(3, 2)
	held(t, s, "k")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { h.Claim(ctx, claimOf(s, "k", "greedy", time.Minute)) })
	}
	require.Eventually(t, func() bool { return h.Waiting() == 2 }, 10*time.Second, time.Millisecond)
	res, err, o := h.Claim(ctx, claimOf(s, "k", "greedy", time.Minute))
	require.NoError(t, err)
	assert.Equal(t, storage.OutcomeInProgress, res.Outcome)
	assert.Equal(t, waiting.Outcome{Ended: waiting.Full, Refused: waiting.BoundIdentity}, o)
	wg.Go(func() { h.Claim(ctx, claimOf(s, "k", "", time.Minute)) })
	require.Eventually(t, func() bool { return h.Waiting() == 3 }, 10*time.Second, time.Millisecond)
	_, _, o = h.Claim(ctx, claimOf(s, "k", "modest", time.Minute))
	assert.Equal(t, waiting.Outcome{Ended: waiting.Full, Refused: waiting.BoundServer}, o)
	cancel()
	wg.Wait()
	assert.Zero(t, h.Waiting())
}

// TestEnds: a wait answers in progress when it elapses, when its caller
// leaves, and when the hub drains, each saying so; a change made through
// another replica (no Notify here) is found by the re-check.
func TestEnds(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(100, 100)
	held(t, s, "k")
	res, err, o := h.Claim(context.Background(), claimOf(s, "k", "", 50*time.Millisecond))
	require.NoError(t, err)
	assert.Equal(t, storage.OutcomeInProgress, res.Outcome)
	assert.Equal(t, waiting.Elapsed, o.Ended)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, _, o = h.Claim(ctx, claimOf(s, "k", "", time.Minute))
	assert.Equal(t, waiting.Canceled, o.Ended)

	other := held(t, s, "other")
	c := claimOf(s, "other", "", time.Minute)
	c.Recheck = 20 * time.Millisecond
	done := make(chan waiting.Outcome, 1)
	go func() { _, _, o := h.Claim(context.Background(), c); done <- o }()
	require.Eventually(t, func() bool { return h.Waiting() == 1 }, 10*time.Second, time.Millisecond)
	_, err = s.Release(context.Background(), storage.ReleaseParams{Key: c.Key, Token: other})
	require.NoError(t, err)
	assert.Equal(t, waiting.Acquired, (<-done).Ended, "the re-check saw the release and the Claim took over")

	go func() { _, _, o := h.Claim(context.Background(), claimOf(s, "k", "", time.Minute)); done <- o }()
	require.Eventually(t, func() bool { return h.Waiting() == 1 }, 10*time.Second, time.Millisecond)
	h.Drain()
	assert.Equal(t, waiting.Drained, (<-done).Ended)
	_, _, o = h.Claim(context.Background(), claimOf(s, "k", "", time.Minute))
	assert.Equal(t, waiting.Drained, o.Ended, "a wait after the drain ends at once")
}

// TestAnsweredAtOnce: a Claim whose first decision needs no wait (a new
// key, a completed one) reports no wait.
func TestAnsweredAtOnce(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(100, 100)
	for i := range 3 {
		res, err, o := h.Claim(context.Background(), claimOf(s, fmt.Sprint("new", i), "", time.Minute))
		require.NoError(t, err)
		assert.Equal(t, storage.OutcomeAcquired, res.Outcome)
		assert.Empty(t, o.Ended)
	}
	assert.Zero(t, h.Waiting())
}

// TestMarkOncePerKey: many waiters on one key of this replica mark the
// record once, for the token they decided on.
func TestMarkOncePerKey(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(100, 100)
	token := held(t, s, "k")
	var (
		mu    sync.Mutex
		marks []int64
	)
	const n = 10
	done := make(chan waiting.Outcome, n)
	for i := range n {
		if i == 1 { // the first is asleep, so it has marked
			require.Eventually(t, func() bool { return h.Waiting() == 1 }, 10*time.Second, time.Millisecond)
		}
		c := claimOf(s, "k", "", time.Minute)
		c.Mark = func(_ context.Context, tok int64) (bool, error) {
			mu.Lock()
			defer mu.Unlock()
			marks = append(marks, tok)
			return true, nil
		}
		go func() {
			_, err, o := h.Claim(context.Background(), c)
			assert.NoError(t, err)
			done <- o
		}()
	}
	require.Eventually(t, func() bool { return h.Waiting() == n }, 10*time.Second, time.Millisecond)
	_, err := s.Complete(context.Background(), storage.CompleteParams{Key: params("k").Key, Token: token, Result: []byte("r")})
	require.NoError(t, err)
	h.Notify(params("k").Key)
	for range n {
		require.Equal(t, waiting.Completed, (<-done).Ended)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int64{token}, marks, "the waiters after the first find the key marked")
}

// TestRefusedMarkDecidesAgain: a mark refused because the attempt ended
// between the decision and the mark (the Complete came through another
// replica, which could not see the mark) sends the Claim to decide again
// at once, not to sleep until a re-check.
func TestRefusedMarkDecidesAgain(t *testing.T) {
	s := open(t)
	h := waiting.NewHub(100, 100)
	token := held(t, s, "k")
	c := claimOf(s, "k", "", time.Minute)
	c.Mark = func(ctx context.Context, tok int64) (bool, error) {
		// The holder completes just after the decision, before the mark.
		_, err := s.Complete(ctx, storage.CompleteParams{Key: params("k").Key, Token: tok, Result: []byte("r")})
		require.NoError(t, err)
		return false, nil
	}
	res, err, o := h.Claim(context.Background(), c)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)
	require.Equal(t, waiting.Completed, o.Ended)
	require.NotZero(t, token)
}
