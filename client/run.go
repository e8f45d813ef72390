package client

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc/status"
)

// claimRepeats is how many times claim repeats a Claim whose answer was
// lost before it gives up.
const claimRepeats = 3

// claim claims p. A parked key is a *ParkedError, so that no caller of
// claim runs its handler for it. While another holder has the key it
// returns an *InProgressError, or, with s.wait, waits until the key is
// completed or acquired, ctx ends or s.waitLimit is spent: each Claim asks
// the registry to wait (up to MaxWait, ctx's deadline and what is left of
// the limit), and a Claim that still finds the key in progress is repeated
// after s.wait's backoff (a registry that does not wait answers at once,
// and is then polled as before).
//
// Every Claim it makes for p carries one request id, so that a Claim whose
// reply was lost (the registry unavailable, or the bookkeeping timeout,
// after the store acquired the key) can be repeated up to claimRepeats
// times and get the same token back, instead of finding the key in
// progress under a lease nobody holds.
func (c *Client) claim(ctx context.Context, p ClaimParams, s *settings) (Claim, error) {
	if p.RequestID == "" {
		p.RequestID = NewRequestID()
	}
	wait := s.wait
	var delay time.Duration
	var waitUntil time.Time
	if wait != nil {
		delay = wait.Initial
		if s.waitLimit > 0 {
			waitUntil = time.Now().Add(s.waitLimit)
		}
	}
	left := func() time.Duration {
		if waitUntil.IsZero() {
			return MaxWait
		}
		return max(time.Until(waitUntil), 0)
	}
	// With batching, the first Claim asks for no wait, so that it can share
	// an RPC (a new key, the common case, needs none); only a duplicate that
	// finds the key in progress pays a second Claim, which waits.
	waiting := c.queue == nil
	repeats, repeatDelay := 0, DefaultBackoff.Initial
	for {
		if wait != nil && waiting {
			p.Wait = min(waitFor(ctx), left())
		}
		cl, err := c.claimOnce(ctx, p, s)
		if err != nil && repeats < claimRepeats && ctx.Err() == nil &&
			(errors.Is(err, ErrUnavailable) || errors.Is(err, ErrDeadlineExceeded)) {
			repeats++
			if !sleepCtx(ctx, retryWait(repeatDelay, err)) {
				return cl, contextError(ctx)
			}
			repeatDelay = min(2*repeatDelay, DefaultBackoff.Max)
			continue
		}
		if err == nil && cl.Outcome == OutcomeParked {
			return cl, &ParkedError{Record: cl.Record}
		}
		if err != nil || cl.Outcome != OutcomeInProgress {
			return cl, err
		}
		if wait == nil || left() <= 0 {
			return cl, &InProgressError{RetryAfter: c.runTimes.retryAfter(p.Consumer, cl.RetryAfter)}
		}
		if !waiting {
			waiting = true
			continue
		}
		// Never sleep past the holder's lease: a crashed holder's key can be
		// taken over from then on.
		sleep := min(jitter(delay), left())
		if cl.RetryAfter > 0 && cl.RetryAfter < sleep {
			sleep = cl.RetryAfter
		}
		if !sleepCtx(ctx, sleep) {
			return cl, contextError(ctx)
		}
		delay = min(2*delay, wait.Max)
	}
}

// waitFor is how long a Claim made under ctx may ask the registry to wait:
// MaxWait, or less when ctx's deadline comes sooner.
func waitFor(ctx context.Context) time.Duration {
	w := MaxWait
	if d, ok := ctx.Deadline(); ok {
		w = min(w, time.Until(d))
	}
	return max(w, 0)
}

// retryWait is how long to wait before repeating a call that failed with
// err, delay being the backoff so far: the jittered delay, or the
// registry's RetryInfo when that is longer.
func retryWait(delay time.Duration, err error) time.Duration {
	wait := jitter(delay)
	if ue := (*UnavailableError)(nil); errors.As(err, &ue) {
		wait = max(wait, ue.RetryAfter)
	}
	return wait
}

// sleepCtx sleeps for d, or until ctx ends, and reports whether it slept.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// claimOnce makes one Claim that outlives ctx. A Claim cut off by the
// caller's deadline may still have acquired the key in the registry, for a
// caller that never learns the token: the key would be stuck until its
// lease ran out. So the Claim runs on its own (bounded by the bookkeeping
// timeout, plus the wait it asks the registry for); if ctx ends first the caller gets ctx's error at once, and a
// claim acquired meanwhile is released in the background.
func (c *Client) claimOnce(ctx context.Context, p ClaimParams, s *settings) (Claim, error) {
	if ctx.Err() != nil {
		return Claim{}, contextError(ctx)
	}
	type answer struct {
		cl  Claim
		err error
	}
	answers := make(chan answer, 1)
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout+p.Wait)
	go func() {
		defer cancel()
		cl, err := c.Claim(dctx, p)
		answers <- answer{cl, err}
	}()
	select {
	case a := <-answers:
		return a.cl, a.err
	case <-ctx.Done():
	}
	go func() {
		a := <-answers
		if a.err != nil || a.cl.Outcome != OutcomeAcquired {
			return
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout)
		defer cancel()
		if _, err := c.Release(rctx, p.Key, a.cl.Fence()); err != nil {
			c.logger.WarnContext(rctx, "idemreg: releasing a claim its caller gave up on failed; the key frees when its lease ends",
				"consumer", p.Consumer, "error", err)
		}
	}()
	return Claim{}, contextError(ctx)
}

// contextError is ctx's error as a typed status error.
func contextError(ctx context.Context) error {
	return FromStatus(status.FromContextError(ctx.Err()))
}

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

// runHeld is the one lifecycle of claimed work, shared by Once, OnceBatch
// and both interceptors: work runs while the lease is extended every half
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

// complete stores r, retrying while the registry is unavailable: repeating
// a Complete with the same token is safe, and the work it records is done.
func (c *Client) complete(ctx context.Context, k Key, f Fence, r Result) (Record, error) {
	delay := DefaultBackoff.Initial
	for {
		rec, err := c.Complete(ctx, k, f, r)
		var ue *UnavailableError
		if err == nil || !errors.As(err, &ue) {
			return rec, err
		}
		if !sleepCtx(ctx, retryWait(delay, err)) {
			return rec, err
		}
		delay = min(2*delay, DefaultBackoff.Max)
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
	delay := DefaultBackoff.Initial
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
		if len(again) == 0 || !sleepCtx(ctx, retryWait(delay, last)) {
			return out
		}
		todo, delay = again, min(2*delay, DefaultBackoff.Max)
	}
}
