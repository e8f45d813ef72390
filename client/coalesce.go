package client

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Batching is how a Client shares RPCs between concurrent calls: Claims
// (without a wait) go together in BatchClaims, Completes in
// BatchCompletes, each item answered exactly as its own call would have
// been. It is on by default (DefaultBatching); WithBatching changes it and
// WithoutBatching turns it off.
//
// A lone call goes out at once, as the unary RPC it always was: there is
// no linger, no queue and no hand-off. Only calls that arrive while
// MaxInFlight RPCs of their kind are already out wait, and the next RPC
// takes all of them (up to MaxItems and MaxBytes). So batches grow with
// the load and never add a wait at low load: the cap on RPCs in flight is
// what lets a queue form at all (without it every call finds the
// connection free and batches stay at one item), and no timer ever runs.
// The RPC is sent by one of the waiting callers, on its own goroutine.
type Batching struct {
	// MaxInFlight is how many RPCs of one kind the client keeps in flight
	// before calls queue for the next; at least 1.
	MaxInFlight int
	// MaxItems and MaxBytes bound one shared RPC (at most MaxBatchItems
	// and MaxBatchBytes, the registry's bounds).
	MaxItems int
	MaxBytes int
}

// DefaultBatching is the batching of a Client built without WithBatching
// or WithoutBatching. MaxInFlight is 8, not 1 or 2, because a BatchClaim
// or BatchComplete of a few items still costs the registry more than the
// unary calls it replaces: measured side by side (docs/benchmarks.md), 2
// in flight gave 8 callers 12% less throughput than unary calls and 64
// callers 17% more; 8 in flight leaves 8 callers as they were and gives 64
// callers 6% more.
var DefaultBatching = Batching{MaxInFlight: 8, MaxItems: 64, MaxBytes: 1 << 20}

func (b Batching) withDefaults() Batching {
	if b.MaxInFlight <= 0 {
		b.MaxInFlight = DefaultBatching.MaxInFlight
	}
	if b.MaxItems <= 0 {
		b.MaxItems = DefaultBatching.MaxItems
	}
	if b.MaxBytes <= 0 {
		b.MaxBytes = DefaultBatching.MaxBytes
	}
	b.MaxItems = min(b.MaxItems, MaxBatchItems)
	b.MaxBytes = min(b.MaxBytes, MaxBatchBytes)
	return b
}

// WithBatching sets how concurrent calls share RPCs (zero fields take
// DefaultBatching's).
func WithBatching(b Batching) ClientOption {
	return func(c *Client) { b := b.withDefaults(); c.batching = &b }
}

// WithoutBatching makes every call its own RPC.
func WithoutBatching() ClientOption { return func(c *Client) { c.batching = nil } }

// The states of a queued call.
const (
	queued int32 = iota
	// taken into a batch that another caller sends.
	taken
	// taken, and this caller sends the batch.
	leading
	// its caller gave up before it was taken: it is not sent.
	abandoned
)

// coalescer shares the RPCs of one kind between concurrent calls.
type coalescer[Req proto.Message, Res any] struct {
	cfg Batching
	// one sends a request on its own.
	one func(ctx context.Context, req Req) (Res, error)
	// many sends several in one RPC and answers each: its result, or its
	// error (every item's, when the RPC failed as a whole).
	many func(ctx context.Context, reqs []Req) ([]Res, []error)
	// shareable says whether a request may share an RPC: one whose bytes
	// would not encode (a string that is not UTF-8) must fail alone.
	shareable func(req Req) bool

	mu       sync.Mutex
	inFlight int
	queue    []*pendingCall[Req, Res]
}

type pendingCall[Req proto.Message, Res any] struct {
	ctx   context.Context
	req   Req
	size  int
	state atomic.Int32
	// done is closed when res and err are set, or, for the caller that
	// sends, when batch is.
	done  chan struct{}
	batch []*pendingCall[Req, Res]
	res   Res
	err   error
}

// do answers req, in an RPC of its own or shared with concurrent calls.
// Each caller keeps its own deadline and cancellation: a caller that gives
// up returns at once, and an RPC already sent for others goes on, on a
// context that outlives them all until the latest of their deadlines.
func (c *coalescer[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	// Calls that carry outgoing metadata of their own (credentials, say)
	// are not mixed with others'.
	if md, ok := metadata.FromOutgoingContext(ctx); (ok && len(md) > 0) || !c.shareable(req) {
		return c.one(ctx, req)
	}
	size := proto.Size(req)
	if size > c.cfg.MaxBytes {
		return c.one(ctx, req)
	}
	c.mu.Lock()
	if c.inFlight < c.cfg.MaxInFlight {
		c.inFlight++
		c.mu.Unlock()
		res, err := c.one(ctx, req)
		c.next()
		return res, err
	}
	p := &pendingCall[Req, Res]{ctx: ctx, req: req, size: size, done: make(chan struct{})}
	c.queue = append(c.queue, p)
	c.mu.Unlock()

	select {
	case <-p.done:
	case <-ctx.Done():
		if p.state.CompareAndSwap(queued, abandoned) {
			var zero Res
			return zero, contextError(ctx)
		}
		if p.state.Load() != leading {
			// Taken by another sender: its answer is of no use now.
			var zero Res
			return zero, contextError(ctx)
		}
		// This caller was to send a batch: the others still need it.
		<-p.done
		go c.sendAndNext(p.batch)
		var zero Res
		return zero, contextError(ctx)
	}
	if p.state.Load() == leading {
		c.sendAndNext(p.batch)
	}
	return p.res, p.err
}

func (c *coalescer[Req, Res]) sendAndNext(batch []*pendingCall[Req, Res]) {
	c.send(batch)
	c.next()
}

// next hands what queued while an RPC was out to one of its callers, who
// sends it, or frees the RPC's place when nothing did.
func (c *coalescer[Req, Res]) next() {
	c.mu.Lock()
	var batch []*pendingCall[Req, Res]
	bytes, n := 0, 0
	for _, p := range c.queue {
		if len(batch) == c.cfg.MaxItems || (len(batch) > 0 && bytes+p.size > c.cfg.MaxBytes) {
			break
		}
		n++
		state := taken
		if len(batch) == 0 {
			state = leading
		}
		if !p.state.CompareAndSwap(queued, state) {
			continue // abandoned
		}
		batch = append(batch, p)
		bytes += p.size
	}
	c.queue = c.queue[n:]
	if len(c.queue) == 0 {
		c.queue = nil // do not keep the backing array of a burst
	}
	if len(batch) == 0 {
		c.inFlight--
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	batch[0].batch = batch
	close(batch[0].done)
}

// send makes the RPC of a batch and answers each of its callers.
func (c *coalescer[Req, Res]) send(batch []*pendingCall[Req, Res]) {
	ctx, cancel := batchContext(batch)
	defer cancel()
	if len(batch) == 1 {
		batch[0].res, batch[0].err = c.one(ctx, batch[0].req)
		return
	}
	reqs := make([]Req, len(batch))
	for i, p := range batch {
		reqs[i] = p.req
	}
	res, errs := c.many(ctx, reqs)
	for i, p := range batch {
		p.res, p.err = res[i], errs[i]
		if i > 0 {
			close(p.done)
		}
	}
}

// batchContext is the context of a shared RPC: the values of its sender's
// (the first caller's), no cancellation, and the latest of the callers'
// deadlines (none when one of them has none), so that no caller's
// deadline cuts another's call short.
func batchContext[Req proto.Message, Res any](batch []*pendingCall[Req, Res]) (context.Context, context.CancelFunc) {
	ctx := context.WithoutCancel(batch[0].ctx)
	var latest time.Time
	for _, p := range batch {
		d, ok := p.ctx.Deadline()
		if !ok {
			return ctx, func() {}
		}
		if d.After(latest) {
			latest = d
		}
	}
	return context.WithDeadline(ctx, latest)
}
