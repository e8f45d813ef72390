package postgres

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Coalescing: one queue, one transaction, one commit.
//
// Each transaction costs a round trip, a commit and the database's fixed
// work per statement; a multi-row statement pays them once for all its
// rows. So concurrent Claims and Completes that arrive together are sent as
// one transaction: the Claims as one multi-row statement (claimBatchSQL)
// and the Completes as another (completeBatchSQL), pipelined in one
// pgx.Batch under one Sync, which PostgreSQL and CockroachDB run as one
// implicit transaction with one commit. Each caller still gets the answer
// for its own key, classified by the same storage.Decide* function as a
// single call's. At any moment about half of a service's calls are
// Completes: one queue for both kinds makes each batch twice the size two
// queues would, and halves the commits.
//
// When batches form: the queue has a number of statement slots
// (WithBatching; DefaultBatchInFlight). A call that finds a slot free,
// nobody queued and its key idle runs alone, with the single-row
// statement, so a lone caller waits for nothing and pays nothing.
// Otherwise it joins the pending batch, which is sent as soon as any of
// these happens: a transaction finishes and frees a slot, the batch
// reaches maxSize items or maxBytes, or the first item in it has waited
// window (a statement stuck on a row lock then does not hold the others up
// for long). The items of an explicit batch (ClaimBatch, CompleteBatch,
// Batch) join the same pending batch, all at once.
//
// Why one slot: the database's cost is per transaction as much as per
// row, so one transaction at a time makes the batches as large as the load
// allows, and commits per call fall as the load grows; measured in
// docs/benchmarks.md.
//
// A key appears at most once in a transaction (PostgreSQL refuses an ON
// CONFLICT DO UPDATE that affects a row twice, and two operations on one
// key must be ordered anyway): a key is busy from the moment its item is
// queued until its answer is final, retries and a run alone included, and
// an item on a busy key waits, in its order, until the key is idle again.
// So an explicit batch's Complete and then Claim of one key are decided in
// that order, the Claim in a later transaction. A batch is sorted by key,
// so concurrent batches lock rows in the same order and rarely deadlock.
//
// Size: a batch carries at most DefaultBatchBytes of parameters
// (CockroachDB refuses a pgwire message over 16 MiB, and 64 results of up
// to 1 MiB would exceed it) and at most MaxExplicitBatch items. A pending
// batch that reaches a bound is sent at once, and a batch over it when sent
// is split in halves, so an item with a large result travels alone or with
// few others.
//
// Failures: a batch is one implicit transaction, so a serialization failure
// or a deadlock rolled all of it back. It is split in two halves, retried
// after a jittered pause, recursively; a single item left over runs alone,
// through the single-row statement and its own retry loop (run), with its
// caller's context. The conflicting key is so isolated in a few steps while
// the others still share transactions. A batch the database refused
// because of one member's input (a data exception, an integrity violation,
// a program limit: memberError) is split the same way, without the pause:
// the member left alone gets its own error from the single-row statement,
// and the others their normal answers. Any other error (the connection
// lost, the database shutting down) is every member's answer, as it would
// be for a single call. A caller whose context ends while it waits returns
// the context's error; if its items were not sent yet they are dropped,
// and if they were, the outcome is as ambiguous as that of a single
// statement cut off mid-flight (see semantics.md). A batch's transaction
// runs under a context that ends when every member's context has ended, or
// at the latest of their deadlines.

// Defaults of WithBatching.
const (
	// DefaultBatchSize is how many items a pending batch gathers before it
	// is sent without waiting for a slot.
	DefaultBatchSize = 64
	// DefaultBatchWindow is the longest an item waits for its batch to be
	// sent while the statement slots are busy.
	DefaultBatchWindow = 10 * time.Millisecond
	// DefaultBatchInFlight is the number of statement slots of the queue.
	DefaultBatchInFlight = 1
	// DefaultBatchBytes bounds the parameters of one batch.
	DefaultBatchBytes = 8 << 20
)

// MaxExplicitBatch is the most items one transaction carries; the byte
// bound may split it more.
const MaxExplicitBatch = 1000

// item is one Claim or Complete in the queue.
type item struct {
	op   storage.Op
	key  storage.Key
	size int // bytes of its parameters in a batched statement
	g    *group

	where place   // guarded by queue.mu
	f     *flight // the transaction it was sent in, once sent (queue.mu)

	// The answer, written by the transaction that decided the item before
	// answered is set; again asks for a run alone (a stale pre-image).
	ans      storage.OpAnswer
	again    bool
	answered atomic.Bool
}

// place is where an item is in the queue.
type place uint8

const (
	placeNone     place = iota
	placePending        // in the pending batch
	placeDeferred       // waiting for its key to be idle
	placeSent           // in a transaction
)

// group is the caller an item answers: a unary call, or an explicit batch.
// Its items share the caller's context, and done is closed when the last
// of them is answered.
type group struct {
	ctx  context.Context
	left atomic.Int64
	done chan struct{}
}

// answer marks it answered; the last answer of its group wakes the caller.
func (it *item) answer() {
	it.answered.Store(true)
	if it.g.left.Add(-1) == 0 {
		close(it.g.done)
	}
}

// unary is a single call's group and item, allocated together.
type unary struct {
	g  group
	it item
}

// queue coalesces the store's Claims and Completes.
type queue struct {
	maxSize  int
	maxBytes int // parameters of one batch
	window   time.Duration
	limit    int // statement slots
	logger   *slog.Logger

	// alone runs one item with the single-row statement and its retries,
	// and sets its answer.
	alone func(context.Context, *item)
	// exec runs items (distinct keys, sorted) as one transaction. When it
	// returns nil it has set every item's answer, or its again; otherwise
	// it has set none.
	exec func(context.Context, []*item) error

	mu       sync.Mutex
	inFlight int // transactions running, alone or batched
	pending  []*item
	bytes    int // sum of the pending items' sizes
	busy     map[storage.Key]struct{}
	deferred []*item // on a busy key, in their order
	timer    *time.Timer
	armed    bool

	// batches and batchedItems count the transactions sent for more than
	// one item and the items they carried, mixed the batches that held
	// both kinds, for tests and the bench.
	batches, batchedItems, mixed atomic.Int64
	// splits counts batches split after a serialization failure or a
	// deadlock, memberSplits those split after a member's input was
	// refused, and largestBytes is the most parameter bytes one batch
	// carried.
	splits, memberSplits, largestBytes atomic.Int64
}

func newQueue(maxSize, maxBytes int, window time.Duration, limit int, logger *slog.Logger,
	alone func(context.Context, *item), exec func(context.Context, []*item) error,
) *queue {
	q := &queue{maxSize: max(maxSize, 1), maxBytes: maxBytes, window: window, limit: max(limit, 1), logger: logger,
		alone: alone, exec: exec, busy: map[storage.Key]struct{}{}}
	q.timer = time.AfterFunc(time.Hour, q.windowEnded)
	q.timer.Stop()
	return q
}

// enter takes a slot for a call that may run alone: a slot is free, nobody
// is queued and its key is idle. The caller runs it, then calls leave.
func (q *queue) enter(key storage.Key) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.pending) != 0 || len(q.deferred) != 0 || q.inFlight >= q.limit {
		return false
	}
	if _, busy := q.busy[key]; busy {
		return false
	}
	q.inFlight++
	q.busy[key] = struct{}{}
	return true
}

// leave ends a call that ran alone (enter).
func (q *queue) leave(key storage.Key) {
	q.mu.Lock()
	delete(q.busy, key)
	send := q.finishLocked()
	q.mu.Unlock()
	if send != nil {
		go send()
	}
}

// one decides op in the queue, alone when enter allows it.
func (q *queue) one(ctx context.Context, op storage.Op, runAlone func() storage.OpAnswer) storage.OpAnswer {
	key := op.Key()
	if q.enter(key) {
		defer q.leave(key)
		return runAlone()
	}
	u := &unary{}
	u.g.ctx, u.g.done = ctx, make(chan struct{})
	u.g.left.Store(1)
	u.it = item{op: op, key: key, size: opBytes(op), g: &u.g}
	q.mu.Lock()
	q.addLocked(&u.it)
	send := q.kickLocked()
	q.mu.Unlock()
	if send != nil {
		go send()
	}
	select {
	case <-u.g.done:
		return u.it.ans
	case <-ctx.Done():
		q.mu.Lock()
		f := q.dropLocked(&u.it)
		q.mu.Unlock()
		f.leave()
		if u.it.answered.Load() {
			return u.it.ans
		}
		return storage.OpAnswer{Err: fmt.Errorf("postgres %s: %w", opName(op), ctx.Err())}
	}
}

// many decides the items of an explicit batch in the queue: they join the
// pending batch together, and items on one key are decided in their order,
// each in a later transaction than the one before it.
func (q *queue) many(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	out := make([]storage.OpAnswer, len(ops))
	if len(ops) == 0 {
		return out
	}
	g := &group{ctx: ctx, done: make(chan struct{})}
	g.left.Store(int64(len(ops)))
	items := make([]item, len(ops))
	for i, op := range ops {
		items[i] = item{op: op, key: op.Key(), size: opBytes(op), g: g}
	}
	q.mu.Lock()
	for i := range items {
		q.addLocked(&items[i])
	}
	send := q.kickLocked()
	q.mu.Unlock()
	if send != nil {
		go send()
	}
	select {
	case <-g.done:
	case <-ctx.Done():
		var left []*flight
		q.mu.Lock()
		for i := range items {
			if f := q.dropLocked(&items[i]); f != nil && !slices.Contains(left, f) {
				left = append(left, f)
			}
		}
		q.mu.Unlock()
		for _, f := range left {
			f.leave()
		}
	}
	for i := range items {
		if items[i].answered.Load() {
			out[i] = items[i].ans
		} else {
			out[i].Err = fmt.Errorf("postgres %s: %w", opName(ops[i]), ctx.Err())
		}
	}
	return out
}

// addLocked queues it: pending, or deferred while its key is busy.
func (q *queue) addLocked(it *item) {
	if _, busy := q.busy[it.key]; busy {
		it.where = placeDeferred
		q.deferred = append(q.deferred, it)
		return
	}
	q.busy[it.key] = struct{}{}
	it.where = placePending
	q.pending = append(q.pending, it)
	q.bytes += it.size
}

// kickLocked returns the function that sends the pending batch when it
// should go now (a slot is free, or it is full), else arms the window.
func (q *queue) kickLocked() func() {
	switch {
	case len(q.pending) == 0:
		return nil
	case q.inFlight < q.limit,
		len(q.pending) >= q.maxSize || q.bytes >= q.maxBytes: // a full batch does not wait for a slot
		q.inFlight++
		return q.takeLocked()
	}
	if !q.armed {
		q.armed = true
		q.timer.Reset(q.window)
	}
	return nil
}

// dropLocked removes an item whose caller left from the queue, unless it
// was sent: then it returns the transaction it was sent in, which the
// caller leaves (flight.leave) once per transaction.
func (q *queue) dropLocked(it *item) *flight {
	switch it.where {
	case placePending:
		if i := slices.Index(q.pending, it); i >= 0 {
			q.pending = slices.Delete(q.pending, i, i+1)
		}
		q.bytes -= it.size
		delete(q.busy, it.key)
		q.promoteLocked()
	case placeDeferred:
		if i := slices.Index(q.deferred, it); i >= 0 {
			q.deferred = slices.Delete(q.deferred, i, i+1)
		}
	case placeSent:
		return it.f
	default:
		return nil
	}
	it.where = placeNone
	return nil
}

// promoteLocked moves the deferred items whose key is idle into the
// pending batch, the first of each key only.
func (q *queue) promoteLocked() {
	if len(q.deferred) == 0 {
		return
	}
	kept := q.deferred[:0]
	for _, it := range q.deferred {
		if _, busy := q.busy[it.key]; busy {
			kept = append(kept, it)
			continue
		}
		q.busy[it.key] = struct{}{}
		it.where = placePending
		q.pending = append(q.pending, it)
		q.bytes += it.size
	}
	clear(q.deferred[len(kept):])
	q.deferred = kept
	if len(q.pending) > 0 && !q.armed {
		q.armed = true
		q.timer.Reset(q.window)
	}
}

// takeLocked removes the pending batch, if any, and returns the function
// that sends it and then frees its slot and its keys; the caller has
// counted the slot.
func (q *queue) takeLocked() func() {
	if len(q.pending) == 0 {
		return nil
	}
	batch := q.pending
	q.pending, q.bytes = nil, 0
	f := newFlight(batch)
	for _, it := range batch {
		it.where, it.f = placeSent, f
	}
	if q.armed {
		q.armed = false
		q.timer.Stop()
	}
	return func() {
		q.send(f.ctx, batch)
		f.cancel()
		q.mu.Lock()
		for _, it := range batch {
			delete(q.busy, it.key)
		}
		send := q.finishLocked()
		q.mu.Unlock()
		// The keys are idle before the callers wake, so that a caller's
		// next call on its key need not wait for them.
		for _, it := range batch {
			it.answer()
		}
		if send != nil {
			go send()
		}
	}
}

// finishLocked frees a slot after a transaction (its keys freed), moves the
// deferred items whose keys are idle up, and hands the slot to the pending
// batch, if any.
func (q *queue) finishLocked() func() {
	q.inFlight--
	q.promoteLocked()
	if q.inFlight >= q.limit || len(q.pending) == 0 {
		return nil
	}
	q.inFlight++
	return q.takeLocked()
}

// windowEnded sends the pending batch whether or not a slot is free.
func (q *queue) windowEnded() {
	q.mu.Lock()
	q.armed = false
	send := q.takeLocked()
	if send != nil {
		q.inFlight++
	}
	q.mu.Unlock()
	if send != nil {
		send()
	}
}

// send decides batch as one transaction under ctx (its flight's),
// splitting it when it is over a bound, on serialization failures and on a
// member's refused input. It sets every item's answer.
func (q *queue) send(ctx context.Context, batch []*item) {
	live := batch
	for i, it := range batch {
		if it.g.ctx.Err() != nil { // its caller has returned
			if len(live) == len(batch) {
				live = slices.Clone(batch[:i])
			}
			it.ans.Err = fmt.Errorf("postgres %s: %w", opName(it.op), it.g.ctx.Err())
			continue
		}
		if len(live) != len(batch) {
			live = append(live, it)
		}
	}
	switch len(live) {
	case 0:
		return
	case 1:
		q.alone(live[0].g.ctx, live[0])
		return
	}
	slices.SortFunc(live, func(x, y *item) int { return compareKeys(x.key, y.key) })
	size := 0
	for _, it := range live {
		size += it.size
	}
	if size > q.maxBytes || len(live) > MaxExplicitBatch {
		q.split(ctx, live)
		return
	}
	q.batches.Add(1)
	q.batchedItems.Add(int64(len(live)))
	for largest := q.largestBytes.Load(); int64(size) > largest; largest = q.largestBytes.Load() {
		if q.largestBytes.CompareAndSwap(largest, int64(size)) {
			break
		}
	}
	err := q.exec(ctx, live)
	switch {
	case err == nil:
		for _, it := range live {
			if it.again {
				it.again = false
				q.alone(it.g.ctx, it)
			}
		}
		return
	case retryable(err):
		q.splits.Add(1)
		q.logger.DebugContext(ctx, "postgres: batch conflicted, splitting it", "items", len(live), "error", err)
		_ = sleep(ctx, backoff(1))
		q.split(ctx, live)
		return
	case memberError(err):
		q.memberSplits.Add(1)
		q.logger.DebugContext(ctx, "postgres: batch refused, splitting it to find the member", "items", len(live), "error", err)
		q.split(ctx, live)
		return
	}
	err = failure("batch", err)
	for _, it := range live {
		it.ans = storage.OpAnswer{Err: err}
	}
}

// split sends the two halves of batch concurrently.
func (q *queue) split(ctx context.Context, batch []*item) {
	half := len(batch) / 2
	var wg sync.WaitGroup
	wg.Go(func() { q.send(ctx, batch[:half]) })
	q.send(ctx, batch[half:])
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

// opName names op's kind in errors.
func opName(op storage.Op) string {
	if op.Claim != nil {
		return "claim"
	}
	return "complete"
}

// opBytes is the bytes op adds to a batched statement: its variable-length
// values, and for each array element its 4-byte length and 8 bytes per
// fixed value.
func opBytes(op storage.Op) int {
	if p := op.Claim; p != nil {
		return len(p.Consumer) + len(p.Key.Key) + len(p.Fingerprint) + len(p.Holder) + len(p.RequestID) + 9*4 + 4*8
	}
	if p := op.Complete; p != nil {
		return len(p.Consumer) + len(p.Key.Key) + len(p.Result) + 5*4 + 2*8
	}
	return 0
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
// program limit (54). The transaction was rolled back whole.
func memberError(err error) bool {
	switch code := sqlState(err); {
	case len(code) != 5:
		return false
	case code[:2] == "22", code[:2] == "23", code[:2] == "54":
		return true
	}
	return false
}

// flight is one transaction of the queue, its splits and retries
// included: its context ends when every caller with an item in it has left
// (their contexts ended: each leaves once, from its own wait, so that no
// caller's context is watched by a callback of its own), and at the latest
// of their deadlines when they all have one. Values are not carried over.
type flight struct {
	ctx    context.Context
	cancel context.CancelFunc
	left   atomic.Int64 // callers still waiting
}

func newFlight(items []*item) *flight {
	var (
		latest time.Time
		groups = 0
		last   *group
	)
	for i, it := range items {
		if it.g == last || slices.ContainsFunc(items[:i], func(x *item) bool { return x.g == it.g }) {
			continue
		}
		last = it.g
		if groups++; groups == 1 || !latest.IsZero() {
			d, ok := it.g.ctx.Deadline()
			switch {
			case !ok:
				latest = time.Time{}
			case groups == 1 || d.After(latest):
				latest = d
			}
		}
	}
	f := &flight{}
	if latest.IsZero() {
		f.ctx, f.cancel = context.WithCancel(context.Background())
	} else {
		f.ctx, f.cancel = context.WithDeadline(context.Background(), latest)
	}
	f.left.Store(int64(groups))
	return f
}

// leave is a caller's leaving; nil does nothing.
func (f *flight) leave() {
	if f != nil && f.left.Add(-1) == 0 {
		f.cancel()
	}
}
