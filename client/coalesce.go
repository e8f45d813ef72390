package client

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// How the client's Claims and Completes go out: route decides, in one
// place, whether a call is its own RPC or waits in the shared queue
// (coalescer); the queue's RPCs are a Batch, or a BatchClaim and a
// BatchComplete for a registry without Batch; and the typed client's
// BatchClaim and BatchComplete split their items within the registry's
// limits.

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

// coalesces says whether this client shares RPCs between concurrent
// calls at all. A Claim that waits never shares one (route), so claim's
// first Claim asks for no wait when it does.
func (c *Client) coalesces() bool { return c.queue != nil }

// route sends req, a *ClaimRequest or a *CompleteRequest, and is the one
// place that decides how: as its own unary RPC, or through the shared
// queue (coalescer.do). A call goes alone when the client does not batch,
// and when sharing an RPC would harm it or the others (shareable); the
// queue sends it alone too while fewer than MaxInFlight RPCs are out.
func (c *Client) route(ctx context.Context, req proto.Message) (proto.Message, error) {
	if c.queue == nil || !shareable(ctx, req) {
		return unary(ctx, c.rpc, req)
	}
	size := queuedSize(req)
	if size > c.queue.cfg.MaxBytes {
		return unary(ctx, c.rpc, req)
	}
	return c.queue.do(ctx, req, size)
}

// shareable says whether req may share an RPC with other callers' calls.
// Not a Claim that waits: it would hold up every call it shared an RPC
// with. Not a call that carries outgoing metadata of its own (credentials,
// say): it is not mixed with others'. Not one whose strings are not UTF-8:
// it would not encode, and must fail alone.
func shareable(ctx context.Context, req proto.Message) bool {
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md) > 0 {
		return false
	}
	switch r := req.(type) {
	case *idemregv1.ClaimRequest:
		return r.GetWait().AsDuration() <= 0 &&
			utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey()) &&
			utf8.ValidString(r.GetHolder()) && utf8.ValidString(r.GetRequestId())
	case *idemregv1.CompleteRequest:
		ok := utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey())
		if resp := r.GetResult().GetResponse(); resp != nil {
			ok = ok && utf8.ValidString(resp.GetType())
		}
		if f := r.GetResult().GetFailure(); f != nil {
			ok = ok && utf8.ValidString(f.GetMessage())
		}
		return ok
	}
	return false
}

// unary sends a Claim or a Complete as its unary RPC.
func unary(ctx context.Context, rpc idemregv1.RegistryServiceClient, req proto.Message) (proto.Message, error) {
	switch r := req.(type) {
	case *idemregv1.ClaimRequest:
		return rpc.Claim(ctx, r)
	case *idemregv1.CompleteRequest:
		return rpc.Complete(ctx, r)
	}
	return nil, status.Errorf(codes.Internal, "idemreg: cannot send a %T", req)
}

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

// do answers req, which route found may share an RPC (size is what it
// adds to one): as its own RPC while fewer than MaxInFlight are out, or
// else in the next shared one. Each caller keeps its own deadline and
// cancellation: a caller that gives up returns at once, and an RPC already
// sent for others goes on, on a context that outlives them all until the
// latest of their deadlines.
func (c *coalescer) do(ctx context.Context, req proto.Message, size int) (proto.Message, error) {
	c.mu.Lock()
	if c.inFlight < c.cfg.MaxInFlight {
		c.inFlight++
		c.mu.Unlock()
		res, err := unary(ctx, c.rpc, req)
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

// many sends several Claims and Completes in one RPC and answers each: its
// response, or its error (every item's, when the RPC failed as a whole).
func (c *coalescer) many(ctx context.Context, reqs []proto.Message) ([]proto.Message, []error) {
	if len(reqs) == 1 {
		res, err := unary(ctx, c.rpc, reqs[0])
		return []proto.Message{res}, []error{err}
	}
	if !c.noBatch.Load() {
		if res, errs, ok := sendBatch(ctx, c.rpc, reqs); ok {
			return res, errs
		}
		c.noBatch.Store(true)
	}
	return c.byKind(ctx, reqs)
}

// sendBatch sends reqs (ClaimRequests and CompleteRequests) as one Batch,
// for the queue and for a Consumer, and answers each: its response (a
// ClaimResponse or a CompleteResponse, matching its request), or its error
// (every item's, when the RPC failed as a whole or did not answer each item
// once in kind). ok is false when the registry does not know the RPC
// (UNIMPLEMENTED), and nothing was decided.
func sendBatch(ctx context.Context, rpc idemregv1.RegistryServiceClient, reqs []proto.Message) (res []proto.Message, errs []error, ok bool) {
	items := make([]*idemregv1.BatchItem, len(reqs))
	for i, r := range reqs {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			items[i] = &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: r}}
		case *idemregv1.CompleteRequest:
			items[i] = &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Complete{Complete: r}}
		}
	}
	resp, err := rpc.Batch(ctx, &idemregv1.BatchRequest{Items: items})
	if status.Code(err) == codes.Unimplemented {
		return nil, nil, false
	}
	results := resp.GetResults()
	if err == nil && len(results) != len(reqs) {
		err = status.Errorf(codes.Internal, "idemreg: Batch answered %d results for %d items", len(results), len(reqs))
	}
	res, errs = make([]proto.Message, len(reqs)), make([]error, len(reqs))
	for i, req := range reqs {
		if err != nil {
			errs[i] = err
			continue
		}
		switch r := results[i].GetResult().(type) {
		case *idemregv1.BatchItemResult_Error:
			errs[i] = status.FromProto(r.Error).Err()
			continue
		case *idemregv1.BatchItemResult_Claim:
			if _, ok := req.(*idemregv1.ClaimRequest); ok {
				res[i] = r.Claim
				continue
			}
		case *idemregv1.BatchItemResult_Complete:
			if _, ok := req.(*idemregv1.CompleteRequest); ok {
				res[i] = r.Complete
				continue
			}
		}
		errs[i] = status.Errorf(codes.Internal, "idemreg: Batch answered item %d (%T) with %T", i, req, results[i].GetResult())
	}
	return res, errs, true
}

// byKind sends reqs to a registry without Batch: the Claims in a
// BatchClaim and the Completes in a BatchComplete, side by side. A key
// that comes again with the other kind starts a new round, sent after the
// one before has been answered, so that each key's items are decided in
// their order, as Batch decides them.
func (c *coalescer) byKind(ctx context.Context, reqs []proto.Message) ([]proto.Message, []error) {
	res, errs := make([]proto.Message, len(reqs)), make([]error, len(reqs))
	type itemKey struct {
		consumer string
		kind     idemregv1.Kind
		key      string
		claim    bool
	}
	keyOf := func(r proto.Message) itemKey {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			return itemKey{r.GetConsumer(), r.GetKind(), r.GetKey(), true}
		case *idemregv1.CompleteRequest:
			return itemKey{r.GetConsumer(), r.GetKind(), r.GetKey(), false}
		}
		return itemKey{}
	}
	seen := map[itemKey]bool{}
	from := 0
	for i := 0; i <= len(reqs); i++ {
		if i < len(reqs) {
			k := keyOf(reqs[i])
			other := k
			other.claim = !k.claim
			if !seen[other] {
				seen[k] = true
				continue
			}
			clear(seen)
			seen[k] = true
		}
		c.round(ctx, reqs[from:i], res[from:i], errs[from:i])
		from = i
	}
	return res, errs
}

// round sends the Claims and the Completes of reqs at once, each kind in
// one RPC (its unary one for a single item), and answers into res and errs.
func (c *coalescer) round(ctx context.Context, reqs []proto.Message, res []proto.Message, errs []error) {
	var claims []*idemregv1.ClaimRequest
	var completes []*idemregv1.CompleteRequest
	var claimAt, completeAt []int
	for i, r := range reqs {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			claims, claimAt = append(claims, r), append(claimAt, i)
		case *idemregv1.CompleteRequest:
			completes, completeAt = append(completes, r), append(completeAt, i)
		}
	}
	var wg sync.WaitGroup
	if len(completes) > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if len(completes) == 1 {
				res[completeAt[0]], errs[completeAt[0]] = unary(ctx, c.rpc, completes[0])
				return
			}
			r, err := c.rpc.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: completes})
			rs, es := itemAnswers(r.GetResults(), err, "BatchComplete", len(completes))
			for j, i := range completeAt {
				res[i], errs[i] = rs[j], es[j]
			}
		}()
	}
	if len(claims) == 1 {
		res[claimAt[0]], errs[claimAt[0]] = unary(ctx, c.rpc, claims[0])
	} else if len(claims) > 1 {
		r, err := c.rpc.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: claims})
		rs, es := itemAnswers(r.GetResults(), err, "BatchClaim", len(claims))
		for j, i := range claimAt {
			res[i], errs[i] = rs[j], es[j]
		}
	}
	wg.Wait()
}

// itemResult is a batch RPC's answer to one item: BatchClaimResult or
// BatchCompleteResult.
type itemResult[Res any] interface {
	GetError() *spb.Status
	GetResponse() Res
}

// itemAnswers splits a batch RPC's answer into each of n items' response
// or error: the RPC's own error for every item when it failed, or did not
// answer each item once.
func itemAnswers[Res any, R itemResult[Res]](results []R, err error, method string, n int) ([]Res, []error) {
	if err == nil && len(results) != n {
		err = status.Errorf(codes.Internal, "idemreg: %s answered %d results for %d requests", method, len(results), n)
	}
	out, errs := make([]Res, n), make([]error, n)
	for i := range n {
		switch {
		case err != nil:
			errs[i] = err
		case results[i].GetError() != nil:
			errs[i] = status.FromProto(results[i].GetError()).Err()
		default:
			out[i] = results[i].GetResponse()
		}
	}
	return out, errs
}

// The registry's limits on one BatchClaim or BatchComplete. BatchClaim and
// BatchComplete split their items into calls within them.
const (
	MaxBatchItems = 500
	MaxBatchBytes = 4 << 20
)

// BatchClaimResult is the answer to one item of BatchClaim: the Claim, or
// the error Claim would have returned for it.
type BatchClaimResult struct {
	Claim Claim
	Err   error
}

// CompleteParams are the arguments of one Complete of BatchComplete.
type CompleteParams struct {
	Key
	Fence  Fence
	Result Result
}

// BatchCompleteResult is the answer to one item of BatchComplete: the
// stored record, or the error Complete would have returned for it.
type BatchCompleteResult struct {
	Record Record
	Err    error
}

// BatchClaim claims every item as Claim would, in order: one result per
// item, its error typed as Claim's (ErrFingerprintMismatch,
// ErrInvalidArgument, ...). A key given twice is decided twice, the second
// time after the first (so it finds the first's claim). Items go in calls
// of at most MaxBatchItems and MaxBatchBytes. When a call fails as a whole
// (the registry unreachable, the deadline), the error is returned and is
// also the Err of each item of that call and of the calls not made.
func (c *Client) BatchClaim(ctx context.Context, ps []ClaimParams) ([]BatchClaimResult, error) {
	reqs := make([]*idemregv1.ClaimRequest, len(ps))
	for i, p := range ps {
		holder := p.Holder
		if holder == "" {
			holder = c.holder
		}
		reqs[i] = p.request(holder)
	}
	out := make([]BatchClaimResult, len(ps))
	var callErr error
	for _, ch := range chunks(reqs) {
		if callErr == nil {
			res, err := c.rpc.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: reqs[ch.from:ch.to]})
			if err == nil && len(res.GetResults()) != ch.to-ch.from {
				err = status.Errorf(codes.Internal, "idemreg: BatchClaim answered %d results for %d requests", len(res.GetResults()), ch.to-ch.from)
			}
			if err == nil {
				for j, r := range res.GetResults() {
					if e := r.GetError(); e != nil {
						out[ch.from+j].Err = FromStatus(status.FromProto(e))
					} else {
						out[ch.from+j].Claim = claimFromProto(r.GetResponse())
					}
				}
				continue
			}
			callErr = FromError(err)
		}
		for i := ch.from; i < ch.to; i++ {
			out[i].Err = callErr
		}
	}
	return out, callErr
}

// BatchComplete completes every item as Complete would, in order, like
// BatchClaim.
func (c *Client) BatchComplete(ctx context.Context, ps []CompleteParams) ([]BatchCompleteResult, error) {
	reqs := make([]*idemregv1.CompleteRequest, len(ps))
	for i, p := range ps {
		consumer, kind, key := p.Key.proto()
		reqs[i] = &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: p.Fence.Token, ClaimSecret: p.Fence.Secret, Result: p.Result.proto()}
	}
	out := make([]BatchCompleteResult, len(ps))
	var callErr error
	for _, ch := range chunks(reqs) {
		if callErr == nil {
			res, err := c.rpc.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: reqs[ch.from:ch.to]})
			if err == nil && len(res.GetResults()) != ch.to-ch.from {
				err = status.Errorf(codes.Internal, "idemreg: BatchComplete answered %d results for %d requests", len(res.GetResults()), ch.to-ch.from)
			}
			if err == nil {
				for j, r := range res.GetResults() {
					if e := r.GetError(); e != nil {
						out[ch.from+j].Err = FromStatus(status.FromProto(e))
					} else {
						out[ch.from+j].Record = recordFromProto(r.GetResponse().GetRecord())
					}
				}
				continue
			}
			callErr = FromError(err)
		}
		for i := ch.from; i < ch.to; i++ {
			out[i].Err = callErr
		}
	}
	return out, callErr
}

type span struct{ from, to int }

// chunks splits items into runs within the registry's batch limits. An
// item larger than MaxBatchBytes on its own goes alone, for the registry
// to refuse with its own error.
func chunks[M proto.Message](items []M) []span {
	var out []span
	from, size := 0, 0
	for i, m := range items {
		n := proto.Size(m)
		n += protowire.SizeTag(1) + protowire.SizeVarint(uint64(n))
		if i > from && (i-from == MaxBatchItems || size+n > MaxBatchBytes) {
			out = append(out, span{from, i})
			from, size = i, 0
		}
		size += n
	}
	if from < len(items) {
		out = append(out, span{from, len(items)})
	}
	return out
}
