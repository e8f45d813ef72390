package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// DefaultLinger is how long a Consumer holds a Complete for the next Claim
// to carry before it sends it alone. A consumer that is fed keeps claiming
// within it; one that is not loses at most this much before its acks.
const DefaultLinger = 5 * time.Millisecond

// ErrConsumerClosed is returned by Handle after Close.
var ErrConsumerClosed = errors.New("idemreg: the consumer is closed")

// ConsumerOption configures Client.Consumer. Every SharedOption and
// MessageOption is one (WithLease, WithRetention, WithWaitInProgress,
// WithInProgressWait, WithBookkeepingTimeout, WithKind), and so is
// WithLinger.
type ConsumerOption interface{ applyConsumer(*consumerSettings) }

type consumerSettings struct {
	*settings
	linger   time.Duration
	inFlight int
}

type consumerOnly func(*consumerSettings)

func (o consumerOnly) applyConsumer(s *consumerSettings) { o(s) }
func (o SharedOption) applyConsumer(s *consumerSettings) { o(s.settings) }
func (o MessageOption) applyConsumer(s *consumerSettings) {
	o(s.settings)
}

// WithLinger sets how long a Complete waits for the consumer's next Claim
// to ride with before it is sent alone (default DefaultLinger; zero or
// less takes the default). It is also bounded by half the lease and half
// the bookkeeping timeout, so that a held Complete always goes out well
// before either runs out. Consumer only.
func WithLinger(d time.Duration) ConsumerOption {
	return consumerOnly(func(s *consumerSettings) { s.linger = d })
}

// DefaultConsumerInFlight is how many Batch RPCs carrying Claims a
// Consumer keeps in flight before its workers' Claims queue for the next,
// which takes all of them and every held Complete: at one worker it never
// queues, and with many their Claims share RPCs and store transactions.
const DefaultConsumerInFlight = 2

// WithConsumerInFlight sets how many Batch RPCs carrying Claims the
// Consumer keeps in flight (default DefaultConsumerInFlight; zero or less
// takes the default). Consumer only.
func WithConsumerInFlight(n int) ConsumerOption {
	return consumerOnly(func(s *consumerSettings) { s.inFlight = n })
}

// Consumer handles the messages of one registry consumer as Once does, with
// one registry round trip per message instead of two: the Complete of a
// message is not sent when its handler returns but held, and goes in the
// same Batch RPC (and so the same store transaction) as the consumer's
// next Claim, from whichever of its workers claims next. A consumer needs
// a message's outcome durable before it acks the message to its broker,
// not before it starts the next one: Handle gives a Done that resolves
// when the registry has stored the outcome, and the caller acks then.
//
// A held Complete goes alone when nothing claims within the linger
// (WithLinger), when its Done is waited on (Done.Wait), or on Flush and
// Close. Each item of a Batch is answered on its own: a refused Claim
// never fails the Completes it carried, nor a lost lease the Claim.
//
// A Consumer is safe for concurrent use by any number of workers: while
// WithConsumerInFlight Batches carrying Claims are out, their Claims queue
// and the next Batch takes all of them, so that many workers share RPCs
// and store transactions as they share held Completes. A
// registry without the Batch RPC (codes.Unimplemented) is remembered, and
// the Consumer then makes Once's calls (Claim, BatchComplete) instead.
type Consumer struct {
	c        *Client
	consumer string
	s        consumerSettings

	mu     sync.Mutex
	held   []*Done
	timer  *time.Timer
	open   map[*Done]struct{}
	closed bool
	// claims waits for a place among the inFlight Batches carrying Claims.
	claims   []*queuedClaim
	inFlight int

	// noBatch is set once the registry answered Batch UNIMPLEMENTED.
	noBatch atomic.Bool
}

// Consumer returns a Consumer of the registry consumer named consumer.
// Close it to send what it holds.
func (c *Client) Consumer(consumer string, opts ...ConsumerOption) *Consumer {
	cs := consumerSettings{settings: newSettings(DefaultClientMissingKey, func(*settings) {})}
	for _, o := range opts {
		o.applyConsumer(&cs)
	}
	if cs.lease <= 0 {
		cs.lease = DefaultLease
	}
	if cs.bookkeepingTimeout <= 0 {
		cs.bookkeepingTimeout = DefaultBookkeepingTimeout
	}
	if cs.linger <= 0 {
		cs.linger = DefaultLinger
	}
	cs.linger = min(cs.linger, cs.lease/2, cs.bookkeepingTimeout/2)
	if cs.inFlight <= 0 {
		cs.inFlight = DefaultConsumerInFlight
	}
	return &Consumer{c: c, consumer: consumer, s: cs, open: map[*Done]struct{}{}}
}

// Done is the bookkeeping of one handled message: it resolves when the
// message's outcome is durable in the registry (nil), or with the error
// that stopped it. Ack the broker's message when Err is nil, and ask for a
// redelivery otherwise.
type Done struct {
	ready chan struct{}
	rec   Record
	err   error

	// Set while its Complete is held or in flight.
	cs       *Consumer
	params   CompleteParams
	req      *idemregv1.CompleteRequest
	size     int
	deadline time.Time
	// sendBy is when a held Complete goes alone whatever else waits: half
	// its lease or half its bookkeeping timeout after the handler ended.
	sendBy time.Time
	// final: the handler's error was Final, so the Complete stores a failure.
	final bool
}

func resolvedDone(rec Record, err error) *Done {
	d := &Done{ready: make(chan struct{}), rec: rec, err: err}
	close(d.ready)
	return d
}

// Ready is closed once the outcome is durable or has failed. Waiting on it
// does not hurry the held Complete: the consumer's next Claim carries it.
func (d *Done) Ready() <-chan struct{} { return d.ready }

// Err is nil once the message's outcome is durable (the handler's result or
// final failure stored, or the message found completed already), and the
// error that stopped it otherwise: the handler's retryable error, an
// *InProgressError, a *ParkedError, ErrLeaseLost when another holder took
// over before the Complete, an *UnavailableError when the registry could
// not be reached within the bookkeeping timeout. It blocks until Ready is
// closed, without hurrying the Complete.
func (d *Done) Err() error {
	<-d.ready
	return d.err
}

// Record is the stored record once Ready is closed and Err is nil.
func (d *Done) Record() Record {
	<-d.ready
	return d.rec
}

// Wait sends the Complete now if it is still held, and waits until the
// outcome is durable or has failed, or ctx ends (its error then; the
// Complete still goes on).
func (d *Done) Wait(ctx context.Context) (Record, error) {
	select {
	case <-d.ready:
		return d.rec, d.err
	default:
	}
	if d.cs != nil {
		d.cs.flush(d)
	}
	select {
	case <-d.ready:
		return d.rec, d.err
	case <-ctx.Done():
		return Record{}, contextError(ctx)
	}
}

func (d *Done) resolve(rec Record, err error) {
	if err != nil {
		if d.final {
			err = fmt.Errorf("idemreg: the final failure was not recorded: %w", err)
		} else {
			err = fmt.Errorf("idemreg: the handler succeeded but its outcome was not recorded: %w", err)
		}
	}
	d.rec, d.err = rec, err
	cs := d.cs
	cs.mu.Lock()
	delete(cs.open, d)
	cs.mu.Unlock()
	close(d.ready)
}

// Handle runs fn at most once to completion per message id, as Once does
// (the same claim, heartbeat, release after a retryable error or a panic,
// final failures stored and replayed), and returns Once's result and
// error. The outcome of a handler that ran is not yet durable when Handle
// returns: the returned Done resolves when it is. A message found
// completed, in progress or parked, or a handler's retryable error, gives
// a Done resolved at once (nil for a completed message, the error
// otherwise).
//
// Ack the message when Done's Err is nil; err only says what happened here
// (a Final error of fn, say, whose failure Done reports stored). opts
// override the Consumer's options for this message (WithMessageFingerprint,
// WithResultType, ...).
func (cs *Consumer) Handle(ctx context.Context, messageID string, fn Handler, opts ...OnceOption) (OnceResult, *Done, error) {
	cs.mu.Lock()
	closed := cs.closed
	cs.mu.Unlock()
	if closed {
		return OnceResult{}, resolvedDone(Record{}, ErrConsumerClosed), ErrConsumerClosed
	}
	s := cs.s.settings
	if len(opts) > 0 {
		one := *s
		for _, o := range opts {
			o.applyOnce(&one)
		}
		s = &one
	}
	k := Key{Consumer: cs.consumer, Kind: s.kind, Key: messageID}
	cl, err := cs.claim(ctx, ClaimParams{Key: k, Fingerprint: s.messageFingerprint, Lease: s.lease, Retention: s.retention}, s)
	if err != nil {
		return OnceResult{Record: cl.Record}, resolvedDone(cl.Record, err), err
	}
	switch cl.Outcome {
	case OutcomeCompleted:
		res, err := replayOnce(cl.Record)
		if err != nil && !IsFinal(err) {
			return res, resolvedDone(cl.Record, err), err
		}
		return res, resolvedDone(cl.Record, nil), err
	case OutcomeAcquired:
	default:
		err := fmt.Errorf("idemreg: unexpected claim outcome %v", cl.Outcome)
		return OnceResult{Record: cl.Record}, resolvedDone(cl.Record, err), err
	}

	r := cs.c.runHandler(ctx, s, k, cl, fn)
	if r.d.release {
		rec, err := cs.c.settleOne(ctx, s, r.held, r.d, r.lost)
		res, err := ranOutcome(cl.Record, r.data, r.fnErr, r.d, rec, err)
		return res, resolvedDone(Record{}, err), err
	}
	// A claim lost while fn ran is still completed: the registry answers
	// LEASE_LOST to Done, as it does to Once.
	consumer, kind, key := k.proto()
	req := &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: r.fence.Token, ClaimSecret: r.fence.Secret, Result: r.d.result.proto()}
	done := &Done{
		ready: make(chan struct{}), cs: cs, req: req, size: heldItemSize(req),
		params:   CompleteParams{Key: k, Fence: r.fence, Result: r.d.result},
		deadline: time.Now().Add(s.bookkeepingTimeout), final: r.fnErr != nil,
		sendBy: time.Now().Add(min(s.lease, s.bookkeepingTimeout) / 2),
	}
	cs.hold(done)
	return OnceResult{Ran: true, Data: r.data, Record: cl.Record}, done, r.fnErr
}

// heldItemSize is what a Complete adds to a Batch request: its BatchItem and
// the item's field header.
func heldItemSize(req *idemregv1.CompleteRequest) int {
	n := proto.Size(req)
	n += protowire.SizeTag(2) + protowire.SizeVarint(uint64(n))
	return n + protowire.SizeTag(1) + protowire.SizeVarint(uint64(n))
}

// hold queues d's Complete for the next Claim, or for the linger's end.
func (cs *Consumer) hold(d *Done) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	cs.open[d] = struct{}{}
	cs.held = append(cs.held, d)
	if cs.timer == nil {
		cs.timer = time.AfterFunc(cs.s.linger, cs.lingered)
	}
}

// take removes from the held Completes as many as fit in a Batch beside
// room bytes of other items.
func (cs *Consumer) take(room int) []*Done {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.takeLocked(room)
}

func (cs *Consumer) takeLocked(room int) []*Done {
	n, size := 0, room
	for _, d := range cs.held {
		if n > 0 && (n+1 == MaxBatchItems || size+d.size > MaxBatchBytes) {
			break
		}
		n++
		size += d.size
	}
	out := cs.held[:n:n]
	cs.held = cs.held[n:]
	if len(cs.held) == 0 {
		cs.held = nil
		if cs.timer != nil {
			cs.timer.Stop()
			cs.timer = nil
		}
	} else if cs.timer == nil {
		cs.timer = time.AfterFunc(cs.s.linger, cs.lingered)
	}
	return out
}

// lingered sends the held Completes alone when the linger ran out, unless
// Claims are queued behind a Batch in flight: the next Batch, sent as soon
// as that one is answered, carries them, unless the oldest has waited until
// its sendBy.
func (cs *Consumer) lingered() {
	cs.mu.Lock()
	if len(cs.claims) > 0 && len(cs.held) > 0 {
		if wait := time.Until(cs.held[0].sendBy); wait > 0 {
			cs.timer = time.AfterFunc(min(cs.s.linger, wait), cs.lingered)
			cs.mu.Unlock()
			return
		}
	}
	cs.mu.Unlock()
	cs.flush(nil)
}

// flush sends the held Completes alone: all of them, or, when only is not
// nil, those taken up to and including only (nothing if only is no longer
// held).
func (cs *Consumer) flush(only *Done) {
	for {
		cs.mu.Lock()
		if only != nil && !containsDone(cs.held, only) {
			cs.mu.Unlock()
			return
		}
		ds := cs.takeLocked(0)
		cs.mu.Unlock()
		if len(ds) == 0 {
			return
		}
		go cs.send(ds, nil)
		if only != nil && containsDone(ds, only) {
			return
		}
	}
}

func containsDone(ds []*Done, d *Done) bool {
	for _, x := range ds {
		if x == d {
			return true
		}
	}
	return false
}

// Flush sends every held Complete and waits until each Complete held or in
// flight when it was called is durable or has failed, or ctx ends.
func (cs *Consumer) Flush(ctx context.Context) error {
	cs.mu.Lock()
	open := make([]*Done, 0, len(cs.open))
	for d := range cs.open {
		open = append(open, d)
	}
	cs.mu.Unlock()
	cs.flush(nil)
	for _, d := range open {
		select {
		case <-d.ready:
		case <-ctx.Done():
			return contextError(ctx)
		}
	}
	return nil
}

// Close refuses further Handles (ErrConsumerClosed) and flushes. Handles
// running when it is called still hold their Complete, sent after the
// linger.
func (cs *Consumer) Close(ctx context.Context) error {
	cs.mu.Lock()
	cs.closed = true
	cs.mu.Unlock()
	return cs.Flush(ctx)
}

// claim claims p as the client's claim does, with the held Completes in
// the same Batch RPC as its first Claim. While the Consumer has its
// WithConsumerInFlight Batches of Claims out, the Claim queues, and the
// next Batch carries every queued Claim and held Complete. Anything but a plain answer (the
// RPC failed, the key is in progress and the consumer waits for it, no
// Batch on the registry) goes on in the client's claim, under the same
// request id: a repeated Claim that the first one acquired gets its token
// back.
func (cs *Consumer) claim(ctx context.Context, p ClaimParams, s *settings) (Claim, error) {
	p.RequestID = NewRequestID()
	if cs.noBatch.Load() {
		if ds := cs.take(0); len(ds) > 0 {
			go cs.completeUntil(time.Now().Add(s.bookkeepingTimeout), ds)
		}
		return cs.c.claim(ctx, p, s)
	}
	if ctx.Err() != nil {
		return Claim{}, contextError(ctx)
	}
	q := &queuedClaim{req: p.request(cs.c.holder), answer: make(chan claimAnswer, 1)}
	q.size = proto.Size(&idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: q.req}}) + 8
	cs.mu.Lock()
	if cs.inFlight < cs.s.inFlight {
		cs.inFlight++
		q.state.Store(takenClaim)
		ds := cs.takeLocked(q.size)
		cs.mu.Unlock()
		go cs.sendClaims(ds, []*queuedClaim{q})
	} else {
		cs.claims = append(cs.claims, q)
		cs.mu.Unlock()
	}
	var a claimAnswer
	select {
	case a = <-q.answer:
	case <-ctx.Done():
		if q.state.CompareAndSwap(queuedClaimState, abandonedClaim) {
			return Claim{}, contextError(ctx) // never sent
		}
		// As in claimOnce: a claim acquired for a caller that left is
		// released rather than stranded until its lease ends.
		go cs.c.releaseAbandoned(registryContext(ctx), s, p.Key, q.answer)
		return Claim{}, contextError(ctx)
	}
	switch {
	case a.err != nil && (repeatable(a.err) || status.Code(a.err) == codes.Unimplemented):
		return cs.c.claim(ctx, p, s)
	case a.err != nil:
		return a.cl, a.err
	case a.cl.Outcome == OutcomeParked:
		return a.cl, &ParkedError{Record: a.cl.Record}
	case a.cl.Outcome == OutcomeInProgress && s.wait == nil:
		return a.cl, cs.c.inProgress(p.Consumer, a.cl)
	case a.cl.Outcome == OutcomeInProgress:
		return cs.c.claim(ctx, p, s)
	default:
		return a.cl, nil
	}
}

// A Claim waiting for a place among the Batches in flight.
type queuedClaim struct {
	req    *idemregv1.ClaimRequest
	size   int
	state  atomic.Int32
	answer chan claimAnswer
}

// The states of a queuedClaim.
const (
	queuedClaimState int32 = iota
	takenClaim
	// abandonedClaim: its caller left before it was taken; it is not sent.
	abandonedClaim
)

// sendClaims sends qs with the Completes of ds in one Batch, answers each
// Claim, and then sends what queued meanwhile, or frees its place.
func (cs *Consumer) sendClaims(ds []*Done, qs []*queuedClaim) {
	for {
		answers := cs.send(ds, qs)
		for i, q := range qs {
			q.answer <- answers[i]
		}
		ds, qs = cs.next()
		if len(qs) == 0 {
			return
		}
	}
}

// next takes the Claims that queued (and every held Complete, within a
// Batch's bounds), or frees a place when none did.
func (cs *Consumer) next() ([]*Done, []*queuedClaim) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	var qs []*queuedClaim
	n, size := 0, 0
	for _, q := range cs.claims {
		if len(qs) > 0 && (len(qs)+1 == MaxBatchItems/2 || size+q.size > MaxBatchBytes/2) {
			break
		}
		n++
		if !q.state.CompareAndSwap(queuedClaimState, takenClaim) {
			continue
		}
		qs = append(qs, q)
		size += q.size
	}
	cs.claims = cs.claims[n:]
	if len(cs.claims) == 0 {
		cs.claims = nil
	}
	if len(qs) == 0 {
		cs.inFlight--
		return nil, nil
	}
	return cs.takeLocked(size), qs
}

// send makes one Batch of the Completes of ds and the Claims of qs,
// resolves each Done with its item's answer, and returns each Claim's.
// It runs on a context of its own, up to the latest of the items'
// bookkeeping deadlines, since its Completes are other callers' and its
// Claims must not be cut off once sent (claimOnce says why). Completes the
// registry could not take while it was unavailable are repeated as Once
// repeats them, until their own deadline, on their own goroutine so that
// the Claims' callers are not held up by them.
func (cs *Consumer) send(ds []*Done, qs []*queuedClaim) []claimAnswer {
	deadline := time.Now().Add(cs.s.bookkeepingTimeout)
	for _, d := range ds {
		if d.deadline.After(deadline) {
			deadline = d.deadline
		}
	}
	answers := make([]claimAnswer, len(qs))
	failAll := func(err error) []claimAnswer {
		for i := range answers {
			answers[i].err = err
		}
		return answers
	}
	if cs.noBatch.Load() {
		go cs.completeUntil(deadline, ds)
		return failAll(status.Error(codes.Unimplemented, "idemreg: the registry has no Batch"))
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	reqs := make([]proto.Message, 0, len(ds)+len(qs))
	for _, d := range ds {
		reqs = append(reqs, d.req)
	}
	for _, q := range qs {
		reqs = append(reqs, q.req)
	}
	res, errs, ok := sendBatch(ctx, cs.c.rpc, reqs)
	if !ok {
		cs.noBatch.Store(true)
		go cs.completeUntil(deadline, ds)
		return failAll(status.Error(codes.Unimplemented, "idemreg: the registry has no Batch"))
	}
	var again []*Done
	for i, d := range ds {
		if err := FromError(errs[i]); err != nil {
			if errors.Is(err, ErrUnavailable) {
				again = append(again, d)
				continue
			}
			d.resolve(Record{}, err)
			continue
		}
		r, _ := res[i].(*idemregv1.CompleteResponse)
		d.resolve(recordFromProto(r.GetRecord()), nil)
	}
	if len(again) > 0 {
		go cs.completeUntil(deadline, again)
	}
	for i := range qs {
		if err := FromError(errs[len(ds)+i]); err != nil {
			answers[i].err = err
			continue
		}
		r, _ := res[len(ds)+i].(*idemregv1.ClaimResponse)
		answers[i].cl = claimFromProto(r)
	}
	return answers
}

func (cs *Consumer) completeUntil(deadline time.Time, ds []*Done) {
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	cs.completeEach(ctx, ds)
}

// completeEach stores the Completes of ds the way Once's bookkeeping does
// (BatchComplete, repeated while the registry is unavailable), for a
// registry without Batch or after a Batch that failed as a whole.
func (cs *Consumer) completeEach(ctx context.Context, ds []*Done) {
	if len(ds) == 0 {
		return
	}
	ps := make([]CompleteParams, len(ds))
	for i, d := range ds {
		ps[i] = d.params
	}
	for i, r := range cs.c.completeBatch(ctx, ps) {
		ds[i].resolve(r.Record, r.Err)
	}
}
