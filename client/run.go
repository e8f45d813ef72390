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

// claim claims p. While another holder has the key it returns an
// *InProgressError, or, with s.wait, polls until the key is completed or
// acquired or ctx ends.
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
	if wait != nil {
		delay = wait.Initial
	}
	repeats, repeatDelay := 0, DefaultBackoff.Initial
	for {
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
		if err != nil || cl.Outcome != OutcomeInProgress {
			return cl, err
		}
		if wait == nil {
			return cl, &InProgressError{RetryAfter: cl.RetryAfter}
		}
		// Never sleep past the holder's lease: a crashed holder's key can be
		// taken over from then on.
		sleep := jitter(delay)
		if cl.RetryAfter > 0 && cl.RetryAfter < sleep {
			sleep = cl.RetryAfter
		}
		if !sleepCtx(ctx, sleep) {
			return cl, contextError(ctx)
		}
		delay = min(2*delay, wait.Max)
	}
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
// timeout); if ctx ends first the caller gets ctx's error at once, and a
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
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout)
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
				errors.Is(err, ErrLeaseTotalExceeded) {
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
