package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
)

// The claim step of Once, OnceBatch, the Consumer and both interceptors:
// one Claim (or BatchClaim) per key, repeated under one request id when
// its answer was lost, and, for a duplicate that waits, repeated until the
// holder's outcome is known. How each Claim goes out (alone or in a shared
// RPC) is coalesce.go's; what follows an acquired claim is lifecycle.go's.

// claimRepeats is how many times claim repeats a Claim whose answer was
// lost before it gives up.
const claimRepeats = 3

// repeatable says whether a Claim that failed with err may have been
// decided without its answer reaching us (the registry unavailable, the
// deadline), so that repeating it under its request id is worth a try.
func repeatable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrDeadlineExceeded)
}

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
	var waits *backoff
	var waitUntil time.Time
	if wait != nil {
		waits = newBackoff(*wait)
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
	// A Claim that waits never shares an RPC, so with batching the first
	// Claim asks for no wait (a new key, the common case, needs none); only
	// a duplicate that finds the key in progress pays a second Claim, which
	// waits.
	waiting := !c.coalesces()
	repeats, repeat := 0, newBackoff(DefaultBackoff)
	for {
		if wait != nil && waiting {
			p.Wait = min(waitFor(ctx), left())
		}
		cl, err := c.claimOnce(ctx, p, s)
		if err != nil && repeats < claimRepeats && ctx.Err() == nil && repeatable(err) {
			repeats++
			if !repeat.wait(ctx, retryInfo(err), 0) {
				return cl, contextError(ctx)
			}
			continue
		}
		if err == nil && cl.Outcome == OutcomeParked {
			return cl, &ParkedError{Record: cl.Record}
		}
		if err != nil || cl.Outcome != OutcomeInProgress {
			return cl, err
		}
		if wait == nil || left() <= 0 {
			return cl, c.inProgress(p.Consumer, cl)
		}
		if !waiting {
			waiting = true
			continue
		}
		// Never sleep past the holder's lease: a crashed holder's key can be
		// taken over from then on.
		ceiling := left()
		if cl.RetryAfter > 0 {
			ceiling = min(ceiling, cl.RetryAfter)
		}
		if !waits.wait(ctx, 0, ceiling) {
			return cl, contextError(ctx)
		}
	}
}

// inProgress is the answer to a Claim that found another holder on the
// key, for a caller that does not wait (or waits no longer): its RetryInfo
// is how long this client saw the consumer's work take, not what is left
// of the holder's lease (runTimes says why).
func (c *Client) inProgress(consumer string, cl Claim) error {
	return &InProgressError{RetryAfter: c.runTimes.retryAfter(consumer, cl.RetryAfter)}
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

// claimOnce makes one Claim that outlives ctx. A Claim cut off by the
// caller's deadline may still have acquired the key in the registry, for a
// caller that never learns the token: the key would be stuck until its
// lease ran out. So the Claim runs on its own (bounded by the bookkeeping
// timeout, plus the wait it asks the registry for); if ctx ends first the
// caller gets ctx's error at once, and a claim acquired meanwhile is
// released in the background (releaseAbandoned).
func (c *Client) claimOnce(ctx context.Context, p ClaimParams, s *settings) (Claim, error) {
	if ctx.Err() != nil {
		return Claim{}, contextError(ctx)
	}
	answers := make(chan claimAnswer, 1)
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout+p.Wait)
	go func() {
		defer cancel()
		cl, err := c.Claim(dctx, p)
		answers <- claimAnswer{cl, err}
	}()
	select {
	case a := <-answers:
		return a.cl, a.err
	case <-ctx.Done():
	}
	go c.releaseAbandoned(ctx, s, p.Key, answers)
	return Claim{}, contextError(ctx)
}

// claimAnswer is a Claim's answer, handed from the goroutine that made it.
type claimAnswer struct {
	cl  Claim
	err error
}

// claimBatch is BatchClaim made the way claim makes a Claim: the whole call
// outlives ctx (bounded by the bookkeeping timeout plus the wait asked
// for), and is repeated with the same request ids when its answer was lost,
// so the claims it acquired come back instead of being stranded.
func (c *Client) claimBatch(ctx context.Context, ps []ClaimParams, wait time.Duration, s *settings) []BatchClaimResult {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout+wait)
	defer cancel()
	dctx = registryContext(dctx)
	repeat := newBackoff(DefaultBackoff)
	for repeats := 0; ; repeats++ {
		rs, err := c.BatchClaim(dctx, ps)
		if err == nil || repeats == claimRepeats || dctx.Err() != nil || !repeatable(err) {
			return rs
		}
		if !repeat.wait(dctx, retryInfo(err), 0) {
			return rs
		}
	}
}

// batchClaims is one round of OnceBatch's claims: the messages of pending
// claimed in one BatchClaim (each under its own request id, kept for the
// whole call), asking the registry to wait on rounds after the first. Each
// message's answer lands in out, except those acquired, returned with
// their claims for the caller to run, and those in progress under another
// holder when s waits, returned to be claimed again in the next round with
// the shortest time left on their holders' leases.
func (c *Client) batchClaims(ctx context.Context, s *settings, pending []int, round int, ps func(i int, wait time.Duration) ClaimParams, out []BatchResult) (acquired []int, claims []Claim, again []int, retryAfter time.Duration) {
	var wait time.Duration
	if round > 0 {
		wait = waitFor(ctx)
	}
	req := make([]ClaimParams, len(pending))
	for j, i := range pending {
		req[j] = ps(i, wait)
	}
	for j, r := range c.claimBatch(ctx, req, wait, s) {
		i := pending[j]
		out[i].Record = r.Claim.Record
		switch {
		case r.Err != nil:
			out[i].Err = r.Err
		case r.Claim.Outcome == OutcomeCompleted:
			out[i].OnceResult, out[i].Err = replayOnce(r.Claim.Record)
		case r.Claim.Outcome == OutcomeParked:
			out[i].Err = &ParkedError{Record: r.Claim.Record}
		case r.Claim.Outcome == OutcomeAcquired:
			acquired, claims = append(acquired, i), append(claims, r.Claim)
		case r.Claim.Outcome == OutcomeInProgress && s.wait != nil:
			again = append(again, i)
			if retryAfter == 0 || r.Claim.RetryAfter < retryAfter {
				retryAfter = r.Claim.RetryAfter
			}
		case r.Claim.Outcome == OutcomeInProgress:
			out[i].Err = c.inProgress(req[j].Consumer, r.Claim)
		default:
			out[i].Err = fmt.Errorf("idemreg: unexpected claim outcome %v", r.Claim.Outcome)
		}
	}
	return acquired, claims, again, retryAfter
}

// batchDuplicates answers the messages of a batch whose id came earlier in
// it: with that message's claim and result (not run here, replayed once its
// outcome is recorded), or, with another fingerprint, a fingerprint
// mismatch, as the registry answers a redelivery with other content.
func batchDuplicates(msgs []BatchMessage, first map[string]int, out []BatchResult) {
	for i, m := range msgs {
		if !out[i].Duplicate {
			continue
		}
		j := first[m.ID]
		dup := BatchResult{OnceResult: out[j].OnceResult, Err: out[j].Err, Duplicate: true}
		dup.Ran = false
		dup.Replayed = out[j].Record.State == StateCompleted
		if !bytes.Equal(m.Fingerprint, msgs[j].Fingerprint) {
			dup = BatchResult{Duplicate: true, Err: FromStatus(newStatus(codes.FailedPrecondition, ReasonFingerprintMismatch,
				"message id "+m.ID+" appears twice in the batch with different fingerprints"))}
		}
		out[i] = dup
	}
}
