package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// fakeOps records what a queue sent where, without a database: exec
// answers each item with its key, alone answers "alone:"+key. Keys are
// Claims, and Completes when they start with "complete-".
type fakeOps struct {
	mu      sync.Mutex
	batches [][]string // keys of each exec, in order
	alone   []string
	// fail returns the error exec fails with for a batch, or nil.
	fail func(keys []string) error
	// hold, when set, blocks the call "blocker" running alone until closed.
	hold chan struct{}
}

func fakeOp(k string) storage.Op {
	key := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: k}
	if strings.HasPrefix(k, "complete-") {
		return storage.Op{Complete: &storage.CompleteParams{Key: key}}
	}
	if n := fakeSize(k); n >= 1<<20 {
		return storage.Op{Complete: &storage.CompleteParams{Key: key, Result: make([]byte, n)}}
	}
	return storage.Op{Claim: &storage.ClaimParams{Key: key}}
}

func fakeAnswer(s string) storage.OpAnswer {
	return storage.OpAnswer{Claim: storage.ClaimResult{Record: storage.Record{Holder: s}}}
}

func (f *fakeOps) runAlone(ctx context.Context, it *item) {
	p := it.key.Key
	f.mu.Lock()
	f.alone = append(f.alone, p)
	hold := f.hold
	f.mu.Unlock()
	if hold != nil && p == "blocker" {
		select {
		case <-hold:
		case <-ctx.Done():
			it.ans = storage.OpAnswer{Err: ctx.Err()}
			return
		}
	}
	it.ans = fakeAnswer("alone:" + p)
}

func (f *fakeOps) exec(_ context.Context, items []*item) error {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.key.Key
	}
	f.mu.Lock()
	f.batches = append(f.batches, keys)
	fail := f.fail
	f.mu.Unlock()
	if fail != nil {
		if err := fail(keys); err != nil {
			return err
		}
	}
	for _, it := range items {
		it.ans = fakeAnswer("batch:" + it.key.Key)
	}
	return nil
}

func newFake(t *testing.T, limit int) (*fakeOps, *queue) {
	t.Helper()
	f := &fakeOps{}
	q := newQueue(64, DefaultBatchBytes, time.Hour, limit, slog.New(slog.DiscardHandler), f.runAlone, f.exec)
	return f, q
}

// do is a unary call of key k through q.
func (f *fakeOps) do(ctx context.Context, q *queue, k string) (string, error) {
	op := fakeOp(k)
	a := q.one(ctx, op, func() storage.OpAnswer {
		it := item{op: op, key: op.Key(), g: &group{ctx: ctx}}
		f.runAlone(ctx, &it)
		return it.ans
	})
	return a.Claim.Record.Holder, a.Err
}

// fakeSize is a key's size: its length, or n MiB for a key "big-n-...".
func fakeSize(p string) int {
	var n int
	if _, err := fmt.Sscanf(p, "big-%d-", &n); err == nil {
		return n << 20
	}
	return len(p)
}

func (q *queue) pendingCalls() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.pending) + len(q.deferred)
}

// occupy holds the only slot with a call that runs alone until release is
// called.
func occupy(t *testing.T, f *fakeOps, q *queue) (release func()) {
	t.Helper()
	f.hold = make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = f.do(t.Context(), q, "blocker")
	}()
	require.Eventually(t, func() bool { q.mu.Lock(); defer q.mu.Unlock(); return q.inFlight == 1 }, 10*time.Second, time.Millisecond)
	return func() {
		f.mu.Lock()
		close(f.hold)
		f.hold = nil
		f.mu.Unlock()
		<-done
	}
}

// queued starts one call per key and returns their answers once
// everything is queued and release was called.
func queued(t *testing.T, ctx context.Context, f *fakeOps, q *queue, release func(), keys ...string) []string {
	t.Helper()
	got := make([]string, len(keys))
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() { got[i], errs[i] = f.do(ctx, q, k) })
	}
	require.Eventually(t, func() bool { return q.pendingCalls() == len(keys) }, 10*time.Second, time.Millisecond)
	release()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			got[i] = "error:" + err.Error()
		}
	}
	return got
}

func TestBatcherLoneCallerRunsAlone(t *testing.T) {
	f, q := newFake(t, 1)
	got, err := f.do(t.Context(), q, "k")
	require.NoError(t, err)
	require.Equal(t, "alone:k", got)
	require.Empty(t, f.batches)
}

func TestBatcherCoalescesWhileSlotsAreBusy(t *testing.T) {
	f, q := newFake(t, 1)
	release := occupy(t, f, q)
	got := queued(t, t.Context(), f, q, release, "d", "b", "c", "a")
	require.Equal(t, []string{"batch:d", "batch:b", "batch:c", "batch:a"}, got, "each caller gets its own answer")
	require.Equal(t, [][]string{{"a", "b", "c", "d"}}, f.batches, "one statement, keys sorted")
	require.EqualValues(t, 1, q.batches.Load())
	require.EqualValues(t, 4, q.batchedItems.Load())
}

func TestBatcherDefersADuplicateKey(t *testing.T) {
	f, q := newFake(t, 1)
	release := occupy(t, f, q)
	got := queued(t, t.Context(), f, q, release, "a", "b", "a", "a")
	require.Equal(t, []string{"a", "b"}, f.batches[0], "a key appears once per statement")
	require.ElementsMatch(t, []string{"batch:a", "batch:b", "alone:a", "alone:a"}, got)
	require.Equal(t, []string{"blocker", "a", "a"}, f.alone, "the duplicates ran one after the other")
}

func TestBatcherSendsAFullBatchAtOnce(t *testing.T) {
	f, q := newFake(t, 1)
	q.maxSize = 3
	release := occupy(t, f, q)
	defer release()
	var wg sync.WaitGroup
	got := make([]string, 3)
	for i, k := range []string{"x", "y", "z"} {
		wg.Go(func() { got[i], _ = f.do(t.Context(), q, k) })
	}
	wg.Wait() // the slot is still held: the size alone sent it
	require.Equal(t, []string{"batch:x", "batch:y", "batch:z"}, got)
}

func TestBatcherSendsWhenTheWindowEnds(t *testing.T) {
	f, q := newFake(t, 1)
	q.window = time.Millisecond
	release := occupy(t, f, q)
	defer release()
	var wg sync.WaitGroup
	got := make([]string, 2)
	for i, k := range []string{"x", "y"} {
		wg.Go(func() { got[i], _ = f.do(t.Context(), q, k) })
	}
	wg.Wait() // the slot is still held: the window sent it
	require.Equal(t, []string{"batch:x", "batch:y"}, got)
}

func serializationFailure() error {
	return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: sqlStateSerializationFailure})
}

func TestBatcherSplitsAConflictingBatch(t *testing.T) {
	f, q := newFake(t, 1)
	f.fail = func(keys []string) error {
		if len(keys) > 1 && slices.Contains(keys, "c") {
			return serializationFailure()
		}
		return nil
	}
	release := occupy(t, f, q)
	got := queued(t, t.Context(), f, q, release, "a", "b", "c", "d", "e", "f", "g", "h")
	require.Equal(t, []string{"batch:a", "batch:b", "alone:c", "alone:d", "batch:e", "batch:f", "batch:g", "batch:h"}, got)
	// a..h fails; a..d fails, e..h passes; a..b passes, c..d fails; c and d
	// run alone, with the single-row statement and its own retries.
	require.ElementsMatch(t, []string{"blocker", "c", "d"}, f.alone)
	require.Len(t, f.batches, 5)
}

func TestBatcherReportsOtherErrorsToEveryCaller(t *testing.T) {
	f, q := newFake(t, 1)
	f.fail = func([]string) error { return errors.New("connection refused") }
	release := occupy(t, f, q)
	got := queued(t, t.Context(), f, q, release, "a", "b")
	for _, g := range got {
		require.Contains(t, g, storage.ErrUnavailable.Error())
		require.Contains(t, g, "connection refused")
	}
}

func TestBatcherSplitsABatchRefusedForOneMember(t *testing.T) {
	f, q := newFake(t, 1)
	f.fail = func(keys []string) error {
		if slices.Contains(keys, "c") { // "c" alone fails too, in runAlone's stead
			return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "22021"})
		}
		return nil
	}
	release := occupy(t, f, q)
	got := queued(t, t.Context(), f, q, release, "a", "b", "c", "d", "e", "f")
	// a..f is refused: a..c is refused, d..f passes; a runs alone, b..c is
	// refused; b and c run alone, and c gets its own error there.
	require.Equal(t, []string{"alone:a", "alone:b", "alone:c", "batch:d", "batch:e", "batch:f"}, got)
	require.ElementsMatch(t, []string{"blocker", "a", "b", "c"}, f.alone)
	require.EqualValues(t, 3, q.memberSplits.Load())
	require.Zero(t, q.splits.Load(), "no pause: nothing conflicted")
}

func TestMemberError(t *testing.T) {
	for _, tc := range []struct {
		code string
		want bool
	}{
		{"22021", true}, // a NUL byte in text
		{"22003", true}, // numeric value out of range
		{"23505", true}, // unique violation
		{"54000", true}, // program limit exceeded
		{"40001", false},
		{"57P01", false}, // admin shutdown: every member's answer
		{"08006", false},
		{"", false},
	} {
		t.Run(tc.code, func(t *testing.T) {
			require.Equal(t, tc.want, memberError(fmt.Errorf("w: %w", &pgconn.PgError{Code: tc.code})))
		})
	}
	require.False(t, memberError(errors.New("connection refused")))
}

func TestBatcherBoundsTheBytesOfAStatement(t *testing.T) {
	f, q := newFake(t, 1)
	release := occupy(t, f, q)
	// Ten calls of 1 MiB and two small ones; the bound is 8 MiB.
	keys := []string{"a", "z"}
	for i := range 10 {
		keys = append(keys, fmt.Sprintf("big-1-%d", i))
	}
	// The pending batch is sent as it reaches the bound, slot or not.
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Go(func() {
			got, err := f.do(t.Context(), q, k)
			assert.NoError(t, err, k)
			assert.Contains(t, got, k)
		})
	}
	require.Eventually(t, func() bool {
		f.mu.Lock()
		sent := 0
		for _, batch := range f.batches {
			sent += len(batch)
		}
		f.mu.Unlock()
		return sent+q.pendingCalls() == len(keys)
	}, 10*time.Second, time.Millisecond)
	release()
	wg.Wait()
	for _, batch := range f.batches {
		size := 0
		for _, k := range batch {
			size += fakeSize(k)
		}
		require.LessOrEqual(t, size, DefaultBatchBytes, "batch %v", batch)
	}
	require.LessOrEqual(t, q.largestBytes.Load(), int64(DefaultBatchBytes))
	require.Greater(t, len(f.batches), 1, "more than one statement")

	// A call over the bound by itself runs alone at once, slot or not.
	f, q = newFake(t, 1)
	release = occupy(t, f, q)
	defer release()
	got, err := f.do(t.Context(), q, "big-9-x")
	require.NoError(t, err)
	require.Equal(t, "alone:big-9-x", got)
	require.Empty(t, f.batches)
}

func TestBatcherDropsACallWhoseContextEnded(t *testing.T) {
	f, q := newFake(t, 1)
	release := occupy(t, f, q)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var cancelledErr error
	wg.Go(func() { _, cancelledErr = f.do(ctx, q, "gone") })
	require.Eventually(t, func() bool { return q.pendingCalls() == 1 }, 10*time.Second, time.Millisecond)
	cancel()
	wg.Wait()
	require.ErrorIs(t, cancelledErr, context.Canceled)
	require.Zero(t, q.pendingCalls())
	got := queued(t, t.Context(), f, q, release, "a", "b")
	require.Equal(t, []string{"batch:a", "batch:b"}, got)
	require.Equal(t, [][]string{{"a", "b"}}, f.batches, "the cancelled call left its batch")
}

// TestFlightContext: a transaction's context has the latest of its
// callers' deadlines (none when one has none), and ends when every caller
// has left, each once however many items it has in it.
func TestFlightContext(t *testing.T) {
	soon, cancelSoon := context.WithTimeout(t.Context(), time.Hour)
	defer cancelSoon()
	later, cancelLater := context.WithTimeout(t.Context(), 2*time.Hour)
	defer cancelLater()
	explicit := &group{ctx: soon}
	unary := &group{ctx: later}
	f := newFlight([]*item{{g: explicit}, {g: unary}, {g: explicit}})
	defer f.cancel()
	d, ok := f.ctx.Deadline()
	require.True(t, ok)
	want, _ := later.Deadline()
	require.Equal(t, want, d, "the latest deadline")

	f.leave() // the explicit batch's caller
	require.NoError(t, f.ctx.Err(), "one caller is still waiting")
	f.leave()
	require.Error(t, f.ctx.Err(), "every caller left")

	f2 := newFlight([]*item{{g: &group{ctx: t.Context()}}, {g: unary}})
	defer f2.cancel()
	_, ok = f2.ctx.Deadline()
	require.False(t, ok, "a caller without a deadline")
	f3 := newFlight([]*item{{g: unary}, {g: &group{ctx: t.Context()}}})
	defer f3.cancel()
	_, ok = f3.ctx.Deadline()
	require.False(t, ok, "a caller without a deadline, second")
}

// TestQueueCallerLeavesItsFlight: a caller whose context ends while its
// item is in a transaction returns at once with the context's error, and
// when every caller in it has left, the transaction's context ends.
func TestQueueCallerLeavesItsFlight(t *testing.T) {
	f, q := newFake(t, 1)
	started := make(chan context.Context, 1)
	q.exec = func(ctx context.Context, items []*item) error {
		started <- ctx
		<-ctx.Done()
		return ctx.Err()
	}
	release := occupy(t, f, q)
	ctxA, cancelA := context.WithCancel(t.Context())
	ctxB, cancelB := context.WithCancel(t.Context())
	errs := make(chan error, 2)
	go func() { _, err := f.do(ctxA, q, "a"); errs <- err }()
	go func() { _, err := f.do(ctxB, q, "b"); errs <- err }()
	require.Eventually(t, func() bool { return q.pendingCalls() == 2 }, 10*time.Second, time.Millisecond)
	release()
	txCtx := <-started
	cancelA()
	require.ErrorIs(t, <-errs, context.Canceled)
	require.NoError(t, txCtx.Err(), "b still waits")
	cancelB()
	require.ErrorIs(t, <-errs, context.Canceled)
	require.Eventually(t, func() bool { return txCtx.Err() != nil }, 10*time.Second, time.Millisecond)
}

// TestQueueExplicitBatchJoinsPending: an explicit batch's items join the
// pending batch beside unary calls of both kinds, one transaction for all;
// its second item on a key waits for the first's transaction.
func TestQueueExplicitBatchJoinsPending(t *testing.T) {
	f, q := newFake(t, 1)
	release := occupy(t, f, q)
	var wg sync.WaitGroup
	unary := make([]string, 2)
	for i, k := range []string{"a", "complete-b"} {
		wg.Go(func() { unary[i], _ = f.do(t.Context(), q, k) })
	}
	var explicit []storage.OpAnswer
	require.Eventually(t, func() bool { return q.pendingCalls() == 2 }, 10*time.Second, time.Millisecond)
	wg.Go(func() {
		explicit = q.many(t.Context(), []storage.Op{fakeOp("complete-c"), fakeOp("d"), fakeOp("complete-c")})
	})
	require.Eventually(t, func() bool { return q.pendingCalls() == 5 }, 10*time.Second, time.Millisecond)
	release()
	wg.Wait()
	require.Equal(t, []string{"batch:a", "batch:complete-b"}, unary)
	holders := make([]string, len(explicit))
	for i, a := range explicit {
		require.NoError(t, a.Err)
		holders[i] = a.Claim.Record.Holder
	}
	require.Equal(t, []string{"batch:complete-c", "batch:d", "alone:complete-c"}, holders)
	require.Equal(t, [][]string{{"a", "complete-b", "complete-c", "d"}}, f.batches, "one transaction, keys sorted")
	require.Equal(t, []string{"blocker", "complete-c"}, f.alone, "the key's second item after the first's transaction")
}

// TestQueueKeyBusyUntilAnswered: an item whose batch answer was stale runs
// again alone before a later item on its key is sent: the key is busy
// until its answer is final, not only until its batch is sent.
func TestQueueKeyBusyUntilAnswered(t *testing.T) {
	f, q := newFake(t, 2)
	var (
		mu    sync.Mutex
		order []string
	)
	gate := make(chan struct{})
	q.exec = func(ctx context.Context, items []*item) error {
		require.NoError(t, f.exec(ctx, items))
		for _, it := range items {
			mu.Lock()
			order = append(order, "batch:"+it.key.Key)
			mu.Unlock()
			if it.key.Key == "x" {
				it.again = true
			}
		}
		return nil
	}
	q.alone = func(ctx context.Context, it *item) {
		if it.key.Key == "x" {
			<-gate // the stale item's run alone is slow
		}
		mu.Lock()
		order = append(order, "alone:"+it.key.Key)
		mu.Unlock()
		f.runAlone(ctx, it)
	}
	done := make(chan []storage.OpAnswer)
	go func() { done <- q.many(t.Context(), []storage.Op{fakeOp("x"), fakeOp("y"), fakeOp("x")}) }()
	// The first transaction (x, y) ran; x waits to run alone, and the
	// second x must not be sent meanwhile, though a slot is free.
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 2 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, q.pendingCalls(), "the second x waits")
	// A call on another key takes the free slot, and goes alone.
	zDone := make(chan string, 1)
	go func() { z, _ := f.do(t.Context(), q, "z"); zDone <- z }()
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 3 }, 10*time.Second, time.Millisecond)
	mu.Lock()
	third := order[2]
	mu.Unlock()
	close(gate)
	require.Equal(t, "alone:z", third, "nothing on x was sent while x ran alone")
	require.Equal(t, "alone:z", <-zDone)
	got := <-done
	for _, a := range got {
		require.NoError(t, a.Err)
	}
	require.Equal(t, []string{"batch:x", "batch:y", "alone:z", "alone:x", "alone:x"}, order)
}

// BenchmarkQueue measures the queue's own Go cost per item, without a
// database (a fake transaction that takes 100 µs, a statement's time, so
// that calls queue behind it): unary calls that coalesce (callers
// goroutines, each with its own context and deadline, as a server's are:
// context-only is what those cost, to subtract), and explicit batches of
// 64.
func BenchmarkQueue(b *testing.B) {
	newQ := func() *queue {
		return newQueue(64, DefaultBatchBytes, time.Millisecond, 1, slog.New(slog.DiscardHandler),
			func(_ context.Context, it *item) { time.Sleep(100 * time.Microsecond); it.ans = storage.OpAnswer{} },
			func(_ context.Context, items []*item) error {
				time.Sleep(100 * time.Microsecond)
				for _, it := range items {
					it.ans = storage.OpAnswer{}
				}
				return nil
			})
	}
	ops := make([]storage.Op, 4096)
	for i := range ops {
		ops[i] = storage.Op{Claim: &storage.ClaimParams{Key: storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: fmt.Sprint("k-", i)}}}
		if i%2 == 1 {
			ops[i] = storage.Op{Complete: &storage.CompleteParams{Key: ops[i].Claim.Key}}
		}
	}
	b.Run("unary/callers=64", func(b *testing.B) {
		q := newQ()
		var next atomic.Int64
		b.ReportAllocs()
		b.SetParallelism(64)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				op := ops[next.Add(1)%int64(len(ops))]
				q.one(ctx, op, func() storage.OpAnswer { time.Sleep(100 * time.Microsecond); return storage.OpAnswer{} })
				cancel()
			}
		})
		batches, items := q.batches.Load(), q.batchedItems.Load()
		b.ReportMetric(float64(items)/float64(max(batches, 1)), "items/batch")
		b.ReportMetric(float64(items)/float64(b.N), "batched/op")
	})
	b.Run("context-only", func(b *testing.B) { // what the callers' contexts cost, to subtract
		b.ReportAllocs()
		for b.Loop() {
			_, cancel := context.WithTimeout(context.Background(), time.Minute)
			cancel()
		}
	})
	b.Run("explicit/size=64", func(b *testing.B) {
		q := newQ()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			start := (i * 64) % len(ops)
			q.many(ctx, ops[start:start+64])
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*64), "ns/item")
	})
}
