package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// The lifecycle of a claim this client acquired, the same for Once,
// OnceBatch, the Consumer and both interceptors: the work runs while a
// heartbeat extends the lease (runHeld), its outcome is recorded within the
// bookkeeping timeout even after the caller's context ended (settle: a
// Complete of the result or of a final failure, or a Release for a
// retryable failure or a panic), and a claim its caller gave up on before
// the answer came is released (releaseAbandoned).

// heartbeat extends a claim every half lease until stopped. When the
// registry says the claim is gone (another holder took over, or the record
// expired or was completed) or can be extended no more (the attempt reached
// its consumer's max_lease_total), it calls lost once and stops: from then
// on the lease runs out, and the work should stop before it does. Other failures
// (the registry briefly unreachable) are retried on the next beat: the lease
// still has half its length to run.
type heartbeat struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	err    error
}

func (c *Client) startHeartbeat(ctx context.Context, k Key, f Fence, lease time.Duration, lost func(error)) *heartbeat {
	ctx, cancel := context.WithCancel(context.WithoutCancel(registryContext(ctx)))
	h := &heartbeat{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		t := time.NewTicker(lease / 2)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			ectx, ecancel := context.WithTimeout(ctx, lease/2)
			_, err := c.Extend(ectx, k, f, lease)
			ecancel()
			if errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotFound) || errors.Is(err, ErrAlreadyCompleted) ||
				errors.Is(err, ErrLeaseTotalExceeded) || errors.Is(err, ErrClaimSecretInvalid) {
				h.mu.Lock()
				h.err = err
				h.mu.Unlock()
				if lost != nil {
					lost(err)
				}
				return
			}
			if err != nil && ctx.Err() == nil {
				c.logger.WarnContext(ctx, "idemreg: lease extension failed; retrying at the next beat",
					"consumer", k.Consumer, "error", err)
			}
		}
	}()
	return h
}

// stop ends the heartbeat and returns the error that ended the claim, if the
// registry reported one.
func (h *heartbeat) stop() error {
	h.cancel()
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// held is a claim this client acquired and runs work under.
type held struct {
	k       Key
	fence   Fence
	attempt int64
}

func heldOf(k Key, cl Claim) held { return held{k: k, fence: cl.Fence(), attempt: cl.Record.Attempt} }

// decision is what work done under a claim leaves to record: a result to
// store, or a release so that a retry can run the work again.
type decision struct {
	result  Result
	release bool
}

// runHeld is the one lifecycle of claimed work, shared by Once, the
// Consumer and both interceptors (OnceBatch holds its claims the same way,
// one after the other, in runBatch): work runs while the lease is extended every half
// lease; should the registry report the claim lost (or its total lease
// spent), work's context is cancelled with that error as cause, since from
// then on its effect may race another holder's. If work panics the key is
// released, because nothing is known of its outcome, and the panic goes
// on. It returns work's decision and the heartbeat's loss; settle records
// the decision.
func (c *Client) runHeld(ctx context.Context, s *settings, h held, work func(context.Context) decision) (d decision, lost error) {
	hd := c.hold(ctx, s, h)
	panicked := true
	defer func() {
		if panicked {
			_ = hd.stop()
			c.releaseAfterPanic(ctx, s, h.k, h.fence)
		}
	}()
	start := time.Now()
	d = work(hd.ctx)
	panicked = false
	c.runTimes.observe(h.k.Consumer, time.Since(start))
	return d, hd.stop()
}

// holding is a held claim whose lease is being extended: from its
// acquisition, not from the start of its work, so that a claim of a batch
// waiting its turn keeps its lease too.
type holding struct {
	held
	// ctx is the work's: cancelled with the loss as cause.
	ctx    context.Context
	cancel context.CancelCauseFunc
	hb     *heartbeat
}

func (c *Client) hold(ctx context.Context, s *settings, h held) *holding {
	wctx, cancel := context.WithCancelCause(ctx)
	return &holding{held: h, ctx: wctx, cancel: cancel, hb: c.startHeartbeat(ctx, h.k, h.fence, s.lease, cancel)}
}

// stop ends the heartbeat and returns the loss it saw, if any.
func (h *holding) stop() error {
	lost := h.hb.stop()
	h.cancel(nil)
	return lost
}

// handlerDecision is what to record for a Handler's return: its data, its
// final failure, or a release for anything else.
func handlerDecision(data []byte, fnErr error) decision {
	switch {
	case fnErr == nil:
		return decision{result: ResponseResult("", data)}
	case IsFinal(fnErr):
		st, ok := status.FromError(fnErr)
		if !ok {
			st = status.New(codes.Unknown, fnErr.Error())
		}
		return decision{result: FailureResult(st)}
	default:
		return decision{release: true}
	}
}

// ran is what runHandler leaves: the claim, what the Handler returned,
// the decision to record and the heartbeat's loss.
type ran struct {
	held
	data  []byte
	fnErr error
	d     decision
	lost  error
}

// runHandler runs fn under cl through runHeld, its data stored with
// s.resultType: the work of Once and of a Consumer's Handle.
func (c *Client) runHandler(ctx context.Context, s *settings, k Key, cl Claim, fn Handler) ran {
	r := ran{held: heldOf(k, cl)}
	r.d, r.lost = c.runHeld(ctx, s, r.held, func(ctx context.Context) decision {
		r.data, r.fnErr = fn(ctx, Attempt{Key: k, Token: r.fence.Token, Attempt: r.attempt})
		d := handlerDecision(r.data, r.fnErr)
		if d.result.Response != nil {
			d.result.Response.Type = s.resultType
		}
		return d
	})
	return r
}

// runOnce runs Once's handler under its claim and records its outcome.
func (c *Client) runOnce(ctx context.Context, k Key, cl Claim, fn Handler, s *settings) (OnceResult, error) {
	r := c.runHandler(ctx, s, k, cl, fn)
	rec, err := c.settleOne(ctx, s, r.held, r.d, r.lost)
	return ranOutcome(cl.Record, r.data, r.fnErr, r.d, rec, err)
}

// ranOutcome is the result of Once for a handler that ran under a claim
// whose record was claimed, given the bookkeeping's record and error.
func ranOutcome(claimed Record, data []byte, fnErr error, d decision, rec Record, err error) (OnceResult, error) {
	res := OnceResult{Ran: true, Data: data, Record: claimed}
	switch {
	case d.release:
		// A failed release is only logged; err is the loss of the claim.
		if err != nil {
			return res, errors.Join(fnErr, err)
		}
		return res, fnErr
	case err != nil && fnErr == nil:
		return res, fmt.Errorf("idemreg: the handler succeeded but its outcome was not recorded: %w", err)
	case err != nil:
		return res, errors.Join(fnErr, fmt.Errorf("idemreg: the final failure was not recorded: %w", err))
	default:
		res.Record = rec
		return res, fnErr
	}
}

// runBatch runs fn for each acquired message in order and records the
// outcomes, through the same runner as Once.
func (c *Client) runBatch(ctx context.Context, s *settings, fn BatchHandler, acquired []int, claims []Claim, keyOf func(int) Key, out []BatchResult) {
	if len(acquired) == 0 {
		return
	}
	hs := make([]held, len(acquired))
	holds := make([]*holding, len(acquired))
	for j, i := range acquired {
		hs[j] = heldOf(keyOf(i), claims[j])
		holds[j] = c.hold(ctx, s, hs[j])
	}
	ds := make([]decision, len(acquired))
	lost := make([]error, len(acquired))
	data := make([][]byte, len(acquired))
	fnErrs := make([]error, len(acquired))
	skipped := make([]bool, len(acquired))
	stopAll := func() {
		for j, h := range holds {
			lost[j] = h.stop()
		}
	}

	ran := 0
	panicked := true
	defer func() {
		if !panicked {
			return
		}
		// Record what was done; the panicking message and those after it
		// never finished, so they are released for a retry.
		stopAll()
		for j := ran; j < len(ds); j++ {
			ds[j] = decision{release: true}
		}
		c.settle(ctx, s, hs, ds, lost)
	}()
	for j, i := range acquired {
		if ctx.Err() != nil {
			ds[j], fnErrs[j], skipped[j] = decision{release: true}, contextError(ctx), true
			ran = j + 1
			continue
		}
		h := holds[j]
		start := time.Now()
		data[j], fnErrs[j] = fn(h.ctx, i, Attempt{Key: h.k, Token: h.fence.Token, Attempt: h.attempt})
		c.runTimes.observe(h.k.Consumer, time.Since(start))
		ds[j] = handlerDecision(data[j], fnErrs[j])
		ran = j + 1
	}
	panicked = false
	stopAll()

	recs, errs := c.settle(ctx, s, hs, ds, lost)
	for j, i := range acquired {
		out[i].OnceResult, out[i].Err = ranOutcome(claims[j].Record, data[j], fnErrs[j], ds[j], recs[j], errs[j])
		out[i].Ran = !skipped[j]
	}
}

// runClaimed runs a call of an interceptor under its claim, through the
// runner Once uses, and records its outcome: the reply, a final error, or a
// release for a retryable one (or a reply that is no protobuf message).
// The call keeps the caller's context rather than the runner's, which is
// cancelled when the lease is lost: a call cut short has an unknown
// outcome, worse than one allowed to finish. Bookkeeping failures are
// logged: the call's own answer goes back to the caller whatever happens
// here.
func (c *Client) runClaimed(ctx context.Context, s *settings, k Key, cl Claim, call func() (proto.Message, error)) {
	h := heldOf(k, cl)
	d, lost := c.runHeld(ctx, s, h, func(context.Context) decision {
		reply, err := call()
		switch {
		case err == nil && reply == nil:
			return decision{release: true}
		case err == nil:
			r, merr := MessageResult(reply)
			if merr != nil {
				c.logger.WarnContext(ctx, "idemreg: encoding the reply failed; the key is released", "consumer", k.Consumer, "error", merr)
				return decision{release: true}
			}
			return decision{result: r}
		case s.retryable(err):
			return decision{release: true}
		default:
			return decision{result: FailureResult(status.Convert(err))}
		}
	})
	if _, err := c.settleOne(ctx, s, h, d, lost); err != nil {
		c.logger.WarnContext(ctx, "idemreg: recording the outcome failed; the key stays claimed until its lease ends",
			"consumer", k.Consumer, "error", err)
	}
}

// settle records the decisions of work done under hs, within the
// bookkeeping timeout even when ctx has ended: the results in one Complete,
// or for several claims in as few BatchCompletes as the limits allow; the
// releases one by one. A claim whose heartbeat reported it lost is not
// released (the key is someone else's now): its error is the loss. A failed
// release is logged and not returned, since the key frees itself when its
// lease ends. It returns, per claim, the stored record and the error of its
// bookkeeping.
func (c *Client) settle(ctx context.Context, s *settings, hs []held, ds []decision, lost []error) ([]Record, []error) {
	bctx, cancel := s.bookkeeping(ctx)
	defer cancel()
	bctx = registryContext(bctx)
	recs, errs := make([]Record, len(hs)), make([]error, len(hs))
	var completes []int
	for i, d := range ds {
		switch {
		case !d.release:
			completes = append(completes, i)
		case lost[i] != nil && !errors.Is(lost[i], ErrLeaseTotalExceeded):
			errs[i] = lost[i]
		default:
			if _, err := c.Release(bctx, hs[i].k, hs[i].fence); err != nil {
				c.logger.WarnContext(ctx, "idemreg: release after the work failed; the key frees when its lease ends",
					"consumer", hs[i].k.Consumer, "error", err)
			}
		}
	}
	if len(completes) == 1 {
		i := completes[0]
		recs[i], errs[i] = c.complete(bctx, hs[i].k, hs[i].fence, ds[i].result)
		return recs, errs
	}
	ps := make([]CompleteParams, len(completes))
	for j, i := range completes {
		ps[j] = CompleteParams{Key: hs[i].k, Fence: hs[i].fence, Result: ds[i].result}
	}
	for j, r := range c.completeBatch(bctx, ps) {
		recs[completes[j]], errs[completes[j]] = r.Record, r.Err
	}
	return recs, errs
}

// settleOne is settle for the one claim of Once, a Consumer's release or
// an interceptor's call.
func (c *Client) settleOne(ctx context.Context, s *settings, h held, d decision, lost error) (Record, error) {
	recs, errs := c.settle(ctx, s, []held{h}, []decision{d}, []error{lost})
	return recs[0], errs[0]
}

// complete stores r, retrying while the registry is unavailable: repeating
// a Complete with the same token is safe, and the work it records is done.
func (c *Client) complete(ctx context.Context, k Key, f Fence, r Result) (Record, error) {
	repeat := newBackoff(DefaultBackoff)
	for {
		rec, err := c.Complete(ctx, k, f, r)
		var ue *UnavailableError
		if err == nil || !errors.As(err, &ue) {
			return rec, err
		}
		if !repeat.wait(ctx, ue.RetryAfter, 0) {
			return rec, err
		}
	}
}

// completeBatch is complete for many claims: BatchComplete, repeating the
// items (or the whole call) the registry could not take while it is
// unavailable.
func (c *Client) completeBatch(ctx context.Context, ps []CompleteParams) []BatchCompleteResult {
	out := make([]BatchCompleteResult, len(ps))
	todo := make([]int, len(ps))
	for i := range todo {
		todo[i] = i
	}
	repeat := newBackoff(DefaultBackoff)
	for {
		req := make([]CompleteParams, len(todo))
		for j, i := range todo {
			req[j] = ps[i]
		}
		rs, err := c.BatchComplete(ctx, req)
		var again []int
		var last error
		for j, i := range todo {
			r := BatchCompleteResult{Err: err}
			if err == nil {
				r = rs[j]
			}
			out[i] = r
			if ue := (*UnavailableError)(nil); errors.As(r.Err, &ue) {
				again, last = append(again, i), r.Err
			}
		}
		if len(again) == 0 || !repeat.wait(ctx, retryInfo(last), 0) {
			return out
		}
		todo = again
	}
}

// releaseAfterPanic gives the key back when the work panicked: nothing
// is known about its outcome, so a retry must be able to run it.
func (c *Client) releaseAfterPanic(ctx context.Context, s *settings, k Key, f Fence) {
	bctx, cancel := s.bookkeeping(ctx)
	defer cancel()
	if _, err := c.Release(registryContext(bctx), k, f); err != nil {
		c.logger.WarnContext(ctx, "idemreg: release after a panic failed", "consumer", k.Consumer, "error", err)
	}
}

// releaseAbandoned releases the claim a Claim's answer acquired for a
// caller that gave up before it came (claimOnce says why), rather than
// leave the key stranded until its lease ends. ctx is the Claim's: its
// values, not its end.
func (c *Client) releaseAbandoned(ctx context.Context, s *settings, k Key, answers <-chan claimAnswer) {
	a := <-answers
	if a.err != nil || a.cl.Outcome != OutcomeAcquired {
		return
	}
	rctx, cancel := s.bookkeeping(ctx)
	defer cancel()
	if _, err := c.Release(rctx, k, a.cl.Fence()); err != nil {
		c.logger.WarnContext(rctx, "idemreg: releasing a claim its caller gave up on failed; the key frees when its lease ends",
			"consumer", k.Consumer, "error", err)
	}
}

// bookkeeping is the context of the Complete or Release after the work: it
// keeps ctx's values but not its deadline or cancellation.
func (s *settings) bookkeeping(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout)
}

// registryContext strips the outgoing metadata of ctx: headers meant for the
// downstream (credentials among them) must not reach the registry.
func registryContext(ctx context.Context) context.Context {
	if _, ok := metadata.FromOutgoingContext(ctx); !ok {
		return ctx
	}
	return metadata.NewOutgoingContext(ctx, metadata.MD{})
}
