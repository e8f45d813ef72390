package client

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Batching is how a Client shares RPCs between concurrent calls: Claims
// (without a wait) and Completes wait in one queue, and the next RPC
// carries all of them as one Batch, which the registry decides in one
// transaction with one commit. Each item is answered exactly as its own
// call would have been. It is on by default (DefaultBatching);
// WithBatching changes it and WithoutBatching turns it off.
//
// A lone call goes out at once, as the unary RPC it always was: there is
// no linger, no timer and no hand-off. Only calls that arrive while
// MaxInFlight RPCs are already out wait, and the next RPC takes all of
// them (up to MaxItems and MaxBytes), in the order they came. So batches
// grow with the load and never add a wait at low load: the cap on RPCs in
// flight is what lets a queue form at all (without it every call finds
// the connection free and batches stay at one item). The RPC is sent by
// one of the waiting callers, on its own goroutine.
//
// A registry older than the Batch RPC answers it UNIMPLEMENTED: the client
// remembers that and from then on sends what queued as a BatchClaim and a
// BatchComplete, keeping the order of a key's items.
type Batching struct {
	// MaxInFlight is how many RPCs of its Claims and Completes (unary or
	// shared, both kinds counted together) the client keeps in flight
	// before calls queue for the next; at least 1. A lower cap makes
	// batches form at fewer callers, and larger ones, at the cost of the
	// round trips it no longer overlaps.
	MaxInFlight int
	// MaxItems and MaxBytes bound one shared RPC (at most MaxBatchItems
	// and MaxBatchBytes, the registry's bounds).
	MaxItems int
	MaxBytes int
}

// DefaultBatching is the batching of a Client built without WithBatching
// or WithoutBatching.
//
// MaxInFlight is 2. With two queues (one per kind) and 8 RPCs of each in
// flight, 8 callers never batched. With one queue, side by side on a quiet
// machine (docs/benchmarks.md, issue 36: `idemreg-bench --client-in-flight
// 1,2 --targets idemreg,sql --callers 1,8,64`, PostgreSQL, fixed windows),
// 2 in flight gave 475, 1,163 and 4,378 pairs/s at 1, 8 and 64 callers
// (0.36×, 0.41× and 1.71× of hand-written SQL), and 1 in flight 442, 1,055
// and 3,655: with one RPC out, the calls that queue wait for its whole
// round trip (the server's and the database's work on the batch happen
// one after the other), so 2 overlaps them at little cost in batch size.
var DefaultBatching = Batching{MaxInFlight: 2, MaxItems: 64, MaxBytes: 1 << 20}

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

// coalescer shares RPCs between a client's concurrent Claims and
// Completes: one queue, so that both kinds ride in one Batch and share
// its commit.
type coalescer struct {
	cfg Batching
	rpc idemregv1.RegistryServiceClient
	// noBatch is set once the registry answered Batch UNIMPLEMENTED (it
	// predates the RPC): shared RPCs are split by kind from then on.
	noBatch atomic.Bool

	mu       sync.Mutex
	inFlight int
	queue    []*pendingCall
}

func newCoalescer(rpc idemregv1.RegistryServiceClient, b Batching) *coalescer {
	return &coalescer{cfg: b, rpc: rpc}
}

type pendingCall struct {
	ctx context.Context
	// req is a *ClaimRequest or a *CompleteRequest, and res the matching
	// response.
	req   proto.Message
	size  int
	state atomic.Int32
	// done is closed when res and err are set, or, for the caller that
	// sends, when batch is.
	done  chan struct{}
	batch []*pendingCall
	res   proto.Message
	err   error
}

// claim answers a Claim that does not wait.
func (c *coalescer) claim(ctx context.Context, req *idemregv1.ClaimRequest) (*idemregv1.ClaimResponse, error) {
	res, err := c.do(ctx, req, claimShareable(req))
	r, _ := res.(*idemregv1.ClaimResponse)
	return r, err
}

// complete answers a Complete.
func (c *coalescer) complete(ctx context.Context, req *idemregv1.CompleteRequest) (*idemregv1.CompleteResponse, error) {
	res, err := c.do(ctx, req, completeShareable(req))
	r, _ := res.(*idemregv1.CompleteResponse)
	return r, err
}

// do answers req, in an RPC of its own or shared with concurrent calls.
// Each caller keeps its own deadline and cancellation: a caller that gives
// up returns at once, and an RPC already sent for others goes on, on a
// context that outlives them all until the latest of their deadlines.
func (c *coalescer) do(ctx context.Context, req proto.Message, shareable bool) (proto.Message, error) {
	// Calls that carry outgoing metadata of their own (credentials, say)
	// are not mixed with others'.
	if md, ok := metadata.FromOutgoingContext(ctx); (ok && len(md) > 0) || !shareable {
		return c.one(ctx, req)
	}
	size := queuedSize(req)
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
	p := &pendingCall{ctx: ctx, req: req, size: size, done: make(chan struct{})}
	c.queue = append(c.queue, p)
	c.mu.Unlock()

	select {
	case <-p.done:
	case <-ctx.Done():
		if p.state.CompareAndSwap(queued, abandoned) {
			return nil, contextError(ctx)
		}
		if p.state.Load() != leading {
			// Taken by another sender: its answer is of no use now.
			return nil, contextError(ctx)
		}
		// This caller was to send a batch: the others still need it, and
		// its own item, not sent yet, is left out (a Claim nobody would
		// use would hold its key until the lease ran out).
		<-p.done
		go c.sendAndNext(p.batch[1:], nil)
		return nil, contextError(ctx)
	}
	if p.state.Load() == leading {
		c.sendAndNext(p.batch, p)
	}
	return p.res, p.err
}

// sendAndNext sends batch, whose sender (if it waits for its answer) is
// leader, then hands on the RPC's place.
func (c *coalescer) sendAndNext(batch []*pendingCall, leader *pendingCall) {
	if len(batch) > 0 {
		c.send(batch, leader)
	}
	c.next()
}

// next hands what queued while an RPC was out to one of its callers, who
// sends it, or frees the RPC's place when nothing did.
func (c *coalescer) next() {
	c.mu.Lock()
	var batch []*pendingCall
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

// send makes the RPC of a batch and answers each of its callers; leader
// reads its own answer once send returns.
func (c *coalescer) send(batch []*pendingCall, leader *pendingCall) {
	ctx, cancel := batchContext(batch)
	defer cancel()
	reqs := make([]proto.Message, len(batch))
	for i, p := range batch {
		reqs[i] = p.req
	}
	res, errs := c.many(ctx, reqs)
	for i, p := range batch {
		p.res, p.err = res[i], errs[i]
		if p != leader {
			close(p.done)
		}
	}
}

// batchContext is the context of a shared RPC: the values of its first
// caller's, no cancellation, and the latest of the callers' deadlines
// (none when one of them has none), so that no caller's deadline cuts
// another's call short.
func batchContext(batch []*pendingCall) (context.Context, context.CancelFunc) {
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

// queuedSize is what req adds to a BatchRequest: itself, inside a BatchItem,
// inside the request's repeated field.
func queuedSize(req proto.Message) int {
	item := protowire.SizeTag(1) + protowire.SizeBytes(proto.Size(req))
	return protowire.SizeTag(1) + protowire.SizeBytes(item)
}
