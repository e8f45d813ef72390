package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// fakeOps records what a batcher sent where, without a database: exec
// answers each call with its key, alone answers "alone:"+key.
type fakeOps struct {
	mu      sync.Mutex
	batches [][]string // keys of each exec, in order
	alone   []string
	// fail returns the error exec fails with for a batch, or nil.
	fail func(keys []string) error
	// hold, when set, blocks the call "blocker" running alone until closed.
	hold chan struct{}
}

func (f *fakeOps) keyOf(p string) storage.Key {
	return storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: p}
}

func (f *fakeOps) runAlone(ctx context.Context, p string) (string, error) {
	f.mu.Lock()
	f.alone = append(f.alone, p)
	hold := f.hold
	f.mu.Unlock()
	if hold != nil && p == "blocker" {
		select {
		case <-hold:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return "alone:" + p, nil
}

func (f *fakeOps) exec(_ context.Context, calls []*call[string, string]) error {
	keys := make([]string, len(calls))
	for i, cl := range calls {
		keys[i] = cl.p
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
	for _, cl := range calls {
		cl.done <- outcome[string]{r: "batch:" + cl.p}
	}
	return nil
}

func newFake(t *testing.T, limit int) (*fakeOps, *coalescer, *batcher[string, string]) {
	t.Helper()
	f := &fakeOps{}
	c := &coalescer{maxSize: 64, maxBytes: DefaultBatchBytes, window: time.Hour, limit: limit}
	s := &Store{logger: slog.New(slog.DiscardHandler)}
	return f, c, newBatcher(c, s, "fake", f.keyOf, fakeSize, f.runAlone, f.exec)
}

// fakeSize is a key's size: its length, or n MiB for a key "big-n-...".
func fakeSize(p string) int {
	var n int
	if _, err := fmt.Sscanf(p, "big-%d-", &n); err == nil {
		return n << 20
	}
	return len(p)
}

func (b *batcher[P, R]) pendingCalls() int {
	b.c.mu.Lock()
	defer b.c.mu.Unlock()
	return len(b.pending) + len(b.deferred)
}

// occupy holds the only slot with a call that runs alone until release is
// called.
func occupy(t *testing.T, f *fakeOps, c *coalescer, b *batcher[string, string]) (release func()) {
	t.Helper()
	f.hold = make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = b.do(t.Context(), "blocker")
	}()
	require.Eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return b.inFlight == 1 }, 10*time.Second, time.Millisecond)
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
func queued(t *testing.T, ctx context.Context, c *coalescer, b *batcher[string, string], release func(), keys ...string) []string {
	t.Helper()
	got := make([]string, len(keys))
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() { got[i], errs[i] = b.do(ctx, k) })
	}
	require.Eventually(t, func() bool { return b.pendingCalls() == len(keys) }, 10*time.Second, time.Millisecond)
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
	f, _, b := newFake(t, 1)
	got, err := b.do(t.Context(), "k")
	require.NoError(t, err)
	require.Equal(t, "alone:k", got)
	require.Empty(t, f.batches)
}

func TestBatcherCoalescesWhileSlotsAreBusy(t *testing.T) {
	f, c, b := newFake(t, 1)
	release := occupy(t, f, c, b)
	got := queued(t, t.Context(), c, b, release, "d", "b", "c", "a")
	require.Equal(t, []string{"batch:d", "batch:b", "batch:c", "batch:a"}, got, "each caller gets its own answer")
	require.Equal(t, [][]string{{"a", "b", "c", "d"}}, f.batches, "one statement, keys sorted")
	require.EqualValues(t, 1, c.batches.Load())
	require.EqualValues(t, 4, c.batchedCalls.Load())
}

func TestBatcherDefersADuplicateKey(t *testing.T) {
	f, c, b := newFake(t, 1)
	release := occupy(t, f, c, b)
	got := queued(t, t.Context(), c, b, release, "a", "b", "a", "a")
	require.Equal(t, []string{"a", "b"}, f.batches[0], "a key appears once per statement")
	require.ElementsMatch(t, []string{"batch:a", "batch:b", "alone:a", "alone:a"}, got)
	require.Equal(t, []string{"blocker", "a", "a"}, f.alone, "the duplicates ran one after the other")
}

func TestBatcherSendsAFullBatchAtOnce(t *testing.T) {
	f, c, b := newFake(t, 1)
	c.maxSize = 3
	release := occupy(t, f, c, b)
	defer release()
	var wg sync.WaitGroup
	got := make([]string, 3)
	for i, k := range []string{"x", "y", "z"} {
		wg.Go(func() { got[i], _ = b.do(t.Context(), k) })
	}
	wg.Wait() // the slot is still held: the size alone sent it
	require.Equal(t, []string{"batch:x", "batch:y", "batch:z"}, got)
}

func TestBatcherSendsWhenTheWindowEnds(t *testing.T) {
	f, c, b := newFake(t, 1)
	c.window = time.Millisecond
	release := occupy(t, f, c, b)
	defer release()
	var wg sync.WaitGroup
	got := make([]string, 2)
	for i, k := range []string{"x", "y"} {
		wg.Go(func() { got[i], _ = b.do(t.Context(), k) })
	}
	wg.Wait() // the slot is still held: the window sent it
	require.Equal(t, []string{"batch:x", "batch:y"}, got)
}

func serializationFailure() error {
	return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: sqlStateSerializationFailure})
}

func TestBatcherSplitsAConflictingBatch(t *testing.T) {
	f, c, b := newFake(t, 1)
	f.fail = func(keys []string) error {
		if len(keys) > 1 && slices.Contains(keys, "c") {
			return serializationFailure()
		}
		return nil
	}
	release := occupy(t, f, c, b)
	got := queued(t, t.Context(), c, b, release, "a", "b", "c", "d", "e", "f", "g", "h")
	require.Equal(t, []string{"batch:a", "batch:b", "alone:c", "alone:d", "batch:e", "batch:f", "batch:g", "batch:h"}, got)
	// a..h fails; a..d fails, e..h passes; a..b passes, c..d fails; c and d
	// run alone, with the single-row statement and its own retries.
	require.ElementsMatch(t, []string{"blocker", "c", "d"}, f.alone)
	require.Len(t, f.batches, 5)
}

func TestBatcherReportsOtherErrorsToEveryCaller(t *testing.T) {
	f, c, b := newFake(t, 1)
	f.fail = func([]string) error { return errors.New("connection refused") }
	release := occupy(t, f, c, b)
	got := queued(t, t.Context(), c, b, release, "a", "b")
	for _, g := range got {
		require.Contains(t, g, storage.ErrUnavailable.Error())
		require.Contains(t, g, "connection refused")
	}
}

func TestBatcherSplitsABatchRefusedForOneMember(t *testing.T) {
	f, c, b := newFake(t, 1)
	f.fail = func(keys []string) error {
		if slices.Contains(keys, "c") { // "c" alone fails too, in runAlone's stead
			return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "22021"})
		}
		return nil
	}
	release := occupy(t, f, c, b)
	got := queued(t, t.Context(), c, b, release, "a", "b", "c", "d", "e", "f")
	// a..f is refused: a..c is refused, d..f passes; a runs alone, b..c is
	// refused; b and c run alone, and c gets its own error there.
	require.Equal(t, []string{"alone:a", "alone:b", "alone:c", "batch:d", "batch:e", "batch:f"}, got)
	require.ElementsMatch(t, []string{"blocker", "a", "b", "c"}, f.alone)
	require.EqualValues(t, 3, c.memberSplits.Load())
	require.Zero(t, c.splits.Load(), "no pause: nothing conflicted")
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
	f, c, b := newFake(t, 1)
	release := occupy(t, f, c, b)
	// Ten calls of 1 MiB and two small ones; the bound is 8 MiB.
	keys := []string{"a", "z"}
	for i := range 10 {
		keys = append(keys, fmt.Sprintf("big-1-%d", i))
	}
	// The pending batch is sent as it reaches the bound, slot or not.
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Go(func() {
			got, err := b.do(t.Context(), k)
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
		return sent+b.pendingCalls() == len(keys)
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
	require.LessOrEqual(t, c.largestBytes.Load(), int64(DefaultBatchBytes))
	require.Greater(t, len(f.batches), 1, "more than one statement")

	// A call over the bound by itself runs alone at once, slot or not.
	f, c, b = newFake(t, 1)
	release = occupy(t, f, c, b)
	defer release()
	got, err := b.do(t.Context(), "big-9-x")
	require.NoError(t, err)
	require.Equal(t, "alone:big-9-x", got)
	require.Empty(t, f.batches)
}

func TestBatcherDropsACallWhoseContextEnded(t *testing.T) {
	f, c, b := newFake(t, 1)
	release := occupy(t, f, c, b)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var cancelledErr error
	wg.Go(func() { _, cancelledErr = b.do(ctx, "gone") })
	require.Eventually(t, func() bool { return b.pendingCalls() == 1 }, 10*time.Second, time.Millisecond)
	cancel()
	wg.Wait()
	require.ErrorIs(t, cancelledErr, context.Canceled)
	require.Zero(t, b.pendingCalls())
	got := queued(t, t.Context(), c, b, release, "a", "b")
	require.Equal(t, []string{"batch:a", "batch:b"}, got)
	require.Equal(t, [][]string{{"a", "b"}}, f.batches, "the cancelled call left its batch")
}

func TestBatchContext(t *testing.T) {
	soon, cancelSoon := context.WithTimeout(t.Context(), time.Hour)
	defer cancelSoon()
	later, cancelLater := context.WithTimeout(t.Context(), 2*time.Hour)
	defer cancelLater()
	calls := []*call[string, string]{{ctx: soon}, {ctx: later}}
	ctx, cancel := batchContext(calls)
	defer cancel()
	d, ok := ctx.Deadline()
	require.True(t, ok)
	want, _ := later.Deadline()
	require.Equal(t, want, d, "the latest deadline")

	cancelSoon()
	require.NoError(t, ctx.Err(), "one member is still waiting")
	cancelLater()
	require.Eventually(t, func() bool { return ctx.Err() != nil }, 10*time.Second, time.Millisecond, "every member left")

	noDeadline := []*call[string, string]{{ctx: t.Context()}, {ctx: later}}
	ctx2, cancel2 := batchContext(noDeadline)
	defer cancel2()
	_, ok = ctx2.Deadline()
	require.False(t, ok, "a member without a deadline")
}
