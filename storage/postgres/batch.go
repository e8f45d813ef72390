package postgres

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Coalescing.
//
// Each statement costs a round trip, a commit and the database's fixed
// work per statement; a multi-row statement pays them once for all its
// rows. So concurrent Claims, and concurrent Completes, that arrive
// together are sent as one statement (claimBatchSQL, completeBatchSQL), and
// each caller still gets the answer for its own key, classified by the same
// storage.Decide* function as a single call's.
//
// When batches form: each kind (Claim, Complete) has a number of statement
// slots (WithBatching; one by default). A call that finds a slot of its kind
// free and nobody queued runs alone, with the single-row statement, so a
// lone caller waits for nothing and pays nothing. Otherwise it joins the
// pending batch of its kind, which is sent as soon as any of these happens:
// a statement of its kind finishes and frees a slot, the batch reaches
// maxSize calls, or the first call in it has waited window (a statement
// stuck on a row lock then does not hold the others up for long).
//
// Why one slot: the database's cost is per statement as much as per row,
// so one statement of each kind at a time makes the batches as large as the
// load allows, and statements per call fall as the load grows. More slots
// cost more CPU per call; measured in docs/benchmarks.md.
//
// Calls on a key already pending wait for the next batch (PostgreSQL
// refuses an ON CONFLICT DO UPDATE that affects a row twice, and two
// operations on one key must be ordered anyway). A batch is sorted by key,
// so concurrent batches lock rows in the same order and rarely deadlock.
//
// Size: a batch carries at most DefaultBatchBytes of parameters
// (CockroachDB refuses a pgwire message over 16 MiB, and 64 results of up
// to 1 MiB would exceed it). A pending batch that reaches the bound is sent
// at once, and a batch over it when sent is split in halves, so a call
// with a large result travels alone or with few others.
//
// Failures: a batch is one implicit transaction, so a serialization failure
// or a deadlock rolled all of it back. It is split in two halves, retried
// after a jittered pause, recursively; a single call left over runs alone,
// through the single-row statement and its own retry loop (run), with its
// caller's context. The conflicting key is so isolated in a few steps while
// the others still share statements. A batch the database refused because
// of one member's input (a data exception, an integrity violation, a
// program limit: memberError) is split the same way, without the pause: the
// member left alone gets its own error from the single-row statement, and
// the others their normal answers. Any other error (the connection lost,
// the database shutting down) is every member's answer, as it would be for
// a single call. A call whose context ends while
// it waits returns the context's error; if its batch was not sent yet it
// is dropped from it, and if it was, the outcome is as ambiguous as that of
// a single statement cut off mid-flight (see semantics.md). A batch's
// statement runs under a context that ends when every member's context has
// ended, or at the latest of their deadlines.

// Defaults of WithBatching.
const (
	// DefaultBatchSize is the largest number of calls in one statement.
	DefaultBatchSize = 64
	// DefaultBatchWindow is the longest a call waits for its batch to be
	// sent while its kind's statement slots are busy.
	DefaultBatchWindow = 10 * time.Millisecond
	// DefaultBatchInFlight is the number of statement slots of each kind.
	DefaultBatchInFlight = 1
	// DefaultBatchBytes bounds the parameters of one batched statement.
	DefaultBatchBytes = 8 << 20
)

// coalescer holds what the batchers of one store share: their settings,
// the mutex that guards their queues, and their statistics.
type coalescer struct {
	maxSize  int
	maxBytes int // parameters of one batched statement
	window   time.Duration
	limit    int // statement slots per kind

	mu sync.Mutex

	// batches and batchedCalls count the statements sent for more than one
	// call and the calls they carried, for tests and the bench.
	batches, batchedCalls atomic.Int64
	// splits counts batches split after a serialization failure or a
	// deadlock, memberSplits those split after a member's input was
	// refused, and largestBytes is the most parameter bytes one batched
	// statement carried.
	splits, memberSplits, largestBytes atomic.Int64
}

// acquireLocked takes a statement slot of b's kind if one is free.
func (b *batcher[P, R]) acquireLocked() bool {
	if b.inFlight >= b.c.limit {
		return false
	}
	b.inFlight++
	return true
}

// release frees a slot and hands it to the pending batch, if any.
func (b *batcher[P, R]) release() {
	b.c.mu.Lock()
	b.inFlight--
	var send func()
	if b.inFlight < b.c.limit {
		if send = b.takeLocked(); send != nil {
			b.inFlight++
		}
	}
	b.c.mu.Unlock()
	if send != nil {
		go send()
	}
}

// call is one caller waiting in a batch.
type call[P, R any] struct {
	ctx  context.Context
	p    P
	key  storage.Key
	size int             // bytes of its parameters in a batched statement
	done chan outcome[R] // buffered: the sender never blocks
}

// outcome is a call's answer; alone asks the caller to run its call by
// itself, with the single-row statement.
type outcome[R any] struct {
	r     R
	err   error
	alone bool
}

// batcher coalesces the calls of one kind (Claim or Complete).
type batcher[P, R any] struct {
	c     *coalescer
	s     *Store
	op    string
	keyOf func(P) storage.Key
	// sizeOf is the bytes a call's parameters add to a batched statement.
	sizeOf func(P) int
	// alone runs one call with the single-row statement and its retries.
	alone func(context.Context, P) (R, error)
	// exec runs one statement for calls (distinct keys, sorted). When it
	// returns nil it has sent every call its outcome; otherwise it has sent
	// none.
	exec func(context.Context, []*call[P, R]) error

	// Guarded by c.mu.
	inFlight int // statements of this kind running, alone or batched
	pending  []*call[P, R]
	bytes    int // sum of the pending calls' sizes
	keys     map[storage.Key]struct{}
	deferred []*call[P, R] // keys already pending, for the next batch
	timer    *time.Timer
	armed    bool
}

func newBatcher[P, R any](c *coalescer, s *Store, op string, keyOf func(P) storage.Key, sizeOf func(P) int,
	alone func(context.Context, P) (R, error), exec func(context.Context, []*call[P, R]) error,
) *batcher[P, R] {
	b := &batcher[P, R]{c: c, s: s, op: op, keyOf: keyOf, sizeOf: sizeOf, alone: alone, exec: exec, keys: map[storage.Key]struct{}{}}
	b.timer = time.AfterFunc(time.Hour, b.windowEnded)
	b.timer.Stop()
	return b
}

// do runs one call: alone when a slot is free and nobody waits, in a batch
// otherwise.
func (b *batcher[P, R]) do(ctx context.Context, p P) (R, error) {
	c := b.c
	c.mu.Lock()
	if len(b.pending) == 0 && len(b.deferred) == 0 && b.acquireLocked() {
		c.mu.Unlock()
		defer b.release()
		return b.alone(ctx, p)
	}
	cl := &call[P, R]{ctx: ctx, p: p, key: b.keyOf(p), size: b.sizeOf(p), done: make(chan outcome[R], 1)}
	b.addLocked(cl)
	var send func()
	if len(b.pending) >= c.maxSize || b.bytes >= c.maxBytes {
		b.inFlight++ // over the limit: a full batch does not wait for a slot
		send = b.takeLocked()
	} else if !b.armed {
		b.armed = true
		b.timer.Reset(c.window)
	}
	c.mu.Unlock()
	if send != nil {
		go send()
	}
	select {
	case o := <-cl.done:
		if o.alone {
			return b.alone(ctx, p)
		}
		return o.r, o.err
	case <-ctx.Done():
		c.mu.Lock()
		b.dropLocked(cl)
		c.mu.Unlock()
		var zero R
		return zero, fmt.Errorf("postgres %s: %w", b.op, ctx.Err())
	}
}

// MaxExplicitBatch is the most items of an explicit batch (ClaimBatch,
// CompleteBatch) one statement carries; the byte bound may split it more.
const MaxExplicitBatch = 1000

// many runs the items of an explicit batch, bypassing the slots: the
// caller asked for them together, so they go out together. Round k holds
// the k-th item of each key, so items on one key run in their order, each
// after the statement of the one before it; each round is one statement
// (split by the size bound and on failures as in send). A single item left
// alone runs through the single-row statement.
func (b *batcher[P, R]) many(ctx context.Context, ps []P) ([]R, []error) {
	rs, errs := make([]R, len(ps)), make([]error, len(ps))
	var rounds [][]int
	seen := make(map[storage.Key]int, len(ps))
	for i, p := range ps {
		k := b.keyOf(p)
		r := seen[k]
		seen[k] = r + 1
		if r == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[r] = append(rounds[r], i)
	}
	for _, round := range rounds {
		for len(round) > 0 {
			chunk := round[:min(len(round), MaxExplicitBatch)]
			round = round[len(chunk):]
			if len(chunk) == 1 {
				i := chunk[0]
				rs[i], errs[i] = b.alone(ctx, ps[i])
				continue
			}
			calls := make([]*call[P, R], len(chunk))
			for j, i := range chunk {
				calls[j] = &call[P, R]{ctx: ctx, p: ps[i], key: b.keyOf(ps[i]), size: b.sizeOf(ps[i]), done: make(chan outcome[R], 1)}
			}
			b.send(slices.Clone(calls)) // send sorts its slice
			for j, cl := range calls {
				i := chunk[j]
				select {
				case o := <-cl.done:
					if o.alone {
						rs[i], errs[i] = b.alone(ctx, ps[i])
					} else {
						rs[i], errs[i] = o.r, o.err
					}
				case <-ctx.Done(): // send gave up on calls whose context ended
					errs[i] = fmt.Errorf("postgres %s: %w", b.op, ctx.Err())
				}
			}
		}
	}
	return rs, errs
}

// dropLocked removes a call whose caller left from the queue, if its batch
// was not sent yet.
func (b *batcher[P, R]) dropLocked(cl *call[P, R]) {
	if i := slices.Index(b.pending, cl); i >= 0 {
		b.pending = slices.Delete(b.pending, i, i+1)
		b.bytes -= cl.size
		delete(b.keys, cl.key)
		return
	}
	if i := slices.Index(b.deferred, cl); i >= 0 {
		b.deferred = slices.Delete(b.deferred, i, i+1)
	}
}

func (b *batcher[P, R]) addLocked(cl *call[P, R]) {
	if _, dup := b.keys[cl.key]; dup {
		b.deferred = append(b.deferred, cl)
		return
	}
	b.keys[cl.key] = struct{}{}
	b.pending = append(b.pending, cl)
	b.bytes += cl.size
}

// takeLocked removes the pending batch, if any, and returns the function
// that sends it and then releases its slot; c.mu is held. The deferred
// calls move up into the next pending batch, whose window starts now.
func (b *batcher[P, R]) takeLocked() func() {
	if len(b.pending) == 0 {
		return nil
	}
	batch := b.pending
	b.pending, b.bytes = nil, 0
	clear(b.keys)
	deferred := b.deferred
	b.deferred = nil
	for _, cl := range deferred {
		b.addLocked(cl)
	}
	if len(b.pending) > 0 {
		b.armed = true
		b.timer.Reset(b.c.window)
	} else if b.armed {
		b.armed = false
		b.timer.Stop()
	}
	return func() {
		defer b.release()
		b.send(batch)
	}
}

// windowEnded sends the pending batch whether or not a slot is free.
func (b *batcher[P, R]) windowEnded() {
	c := b.c
	c.mu.Lock()
	b.armed = false
	send := b.takeLocked()
	if send != nil {
		b.inFlight++
	}
	c.mu.Unlock()
	if send != nil {
		send()
	}
}

// send runs batch as one statement, splitting it when it is over the size
// bound, on serialization failures and on a member's refused input.
func (b *batcher[P, R]) send(batch []*call[P, R]) {
	live := batch[:0]
	for _, cl := range batch {
		if cl.ctx.Err() == nil { // the others' callers have returned
			live = append(live, cl)
		}
	}
	switch len(live) {
	case 0:
		return
	case 1:
		live[0].done <- outcome[R]{alone: true}
		return
	}
	slices.SortFunc(live, func(x, y *call[P, R]) int { return compareKeys(x.key, y.key) })
	size := 0
	for _, cl := range live {
		size += cl.size
	}
	if size > b.c.maxBytes {
		b.split(live)
		return
	}
	ctx, cancel := batchContext(live)
	defer cancel()
	b.c.batches.Add(1)
	b.c.batchedCalls.Add(int64(len(live)))
	for largest := b.c.largestBytes.Load(); int64(size) > largest; largest = b.c.largestBytes.Load() {
		if b.c.largestBytes.CompareAndSwap(largest, int64(size)) {
			break
		}
	}
	err := b.exec(ctx, live)
	switch {
	case err == nil:
		return
	case retryable(err):
		b.c.splits.Add(1)
		b.s.logger.DebugContext(ctx, "postgres: batch conflicted, splitting it", "op", b.op, "calls", len(live), "error", err)
		_ = sleep(ctx, backoff(1))
		b.split(live)
		return
	case memberError(err):
		b.c.memberSplits.Add(1)
		b.s.logger.DebugContext(ctx, "postgres: batch refused, splitting it to find the member", "op", b.op, "calls", len(live), "error", err)
		b.split(live)
		return
	}
	err = failure(b.op, err)
	for _, cl := range live {
		cl.done <- outcome[R]{err: err}
	}
}

// split sends the two halves of batch concurrently.
func (b *batcher[P, R]) split(batch []*call[P, R]) {
	half := len(batch) / 2
	var wg sync.WaitGroup
	wg.Go(func() { b.send(batch[:half]) })
	b.send(batch[half:])
	wg.Wait()
}

func compareKeys(x, y storage.Key) int {
	if c := cmp.Compare(x.Consumer, y.Consumer); c != 0 {
		return c
	}
	if c := cmp.Compare(x.Kind, y.Kind); c != 0 {
		return c
	}
	return cmp.Compare(x.Key, y.Key)
}

// retryable reports a failure that rolled the statement back and that
// retrying may cure: what run retries.
func retryable(err error) bool {
	switch sqlState(err) {
	case sqlStateSerializationFailure, sqlStateDeadlockDetected, "CR000":
		return true
	}
	return false
}

// memberError reports an error by which the database refused a statement
// for what one of its rows carried, so that a batch holding that row must
// not fail the others: a data exception (SQLSTATE class 22, such as a NUL
// byte in a text value), an integrity constraint violation (23) or a
// program limit (54). The statement was rolled back whole.
func memberError(err error) bool {
	switch code := sqlState(err); {
	case len(code) != 5:
		return false
	case code[:2] == "22", code[:2] == "23", code[:2] == "54":
		return true
	}
	return false
}

// batchContext is the context of a batch's statement: it ends when every
// member's context has ended, and at the latest of their deadlines when
// they all have one. Values are not carried over.
func batchContext[P, R any](calls []*call[P, R]) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	var latest time.Time
	for _, cl := range calls {
		d, ok := cl.ctx.Deadline()
		if !ok {
			latest = time.Time{}
			break
		}
		if d.After(latest) {
			latest = d
		}
	}
	cancelDeadline := context.CancelFunc(func() {})
	if !latest.IsZero() {
		ctx, cancelDeadline = context.WithDeadline(ctx, latest)
	}
	var left atomic.Int64
	left.Store(int64(len(calls)))
	stops := make([]func() bool, len(calls))
	for i, cl := range calls {
		stops[i] = context.AfterFunc(cl.ctx, func() {
			if left.Add(-1) == 0 {
				cancel()
			}
		})
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancelDeadline()
		cancel()
	}
}
