package client

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
)

// BatchMessage is one message of a batch given to OnceBatch.
type BatchMessage struct {
	// ID is the message id, the key claimed.
	ID string
	// Fingerprint is an optional hash of the content, as for
	// WithMessageFingerprint.
	Fingerprint []byte
}

// BatchHandler does the work of message i of OnceBatch's batch, under the
// claim a, like a Handler.
type BatchHandler func(ctx context.Context, i int, a Attempt) (data []byte, err error)

// BatchResult is what OnceBatch did with one message: what Once would have
// returned for it.
type BatchResult struct {
	OnceResult
	// Err is the error Once would have returned: nil or IsFinal means the
	// message may be acknowledged.
	Err error
	// Duplicate: the id appeared earlier in the batch. Its claim is that
	// earlier message's, and so is its result (with Ran false and Replayed
	// true once that message's outcome is recorded); with another
	// Fingerprint, Err matches ErrFingerprintMismatch.
	Duplicate bool
}

// OnceBatch is Once for a fetched batch of messages of consumer: it claims
// them all in one BatchClaim (calls of at most MaxBatchItems), runs fn for
// each message it acquired, one after the other in batch order, and
// records the outcomes in one BatchComplete, releasing the claims of
// retryable failures one by one. Each result says, like Once, whether fn
// ran or the stored outcome was replayed, and the error Once would have
// returned; acknowledge a message when its Err is nil or IsFinal.
//
// Every acquired claim's lease is extended from its acquisition until its
// outcome is recorded, so a message waiting its turn keeps its claim; a
// message whose lease was lost has fn's context cancelled as in Once.
// Handlers run one at a time: for parallelism run several batches at once.
// Once ctx has ended the messages not yet run are released unrun, with the
// context's error. Should fn panic, the outcomes of the messages already
// run are recorded, the claims of the others released, and the panic goes
// on.
//
// A message in progress under another holder gets an *InProgressError, or
// with WithWaitInProgress is claimed again, asking the registry to wait,
// after the messages acquired at first have been run and recorded (so that
// waiting holds none of them up).
//
// Options: WithLease, WithRetention, WithWaitInProgress,
// WithBookkeepingTimeout, WithKind.
func (c *Client) OnceBatch(ctx context.Context, consumer string, msgs []BatchMessage, fn BatchHandler, opts ...BatchOption) []BatchResult {
	s := batchSettings(opts)
	out := make([]BatchResult, len(msgs))
	first := make(map[string]int, len(msgs))
	var pending []int
	// One request id per message for the whole call: a BatchClaim whose
	// answer was lost, repeated, gets its acquired claims back.
	reqIDs := make([]string, len(msgs))
	for i, m := range msgs {
		if _, ok := first[m.ID]; ok {
			out[i].Duplicate = true
			continue
		}
		first[m.ID] = i
		pending = append(pending, i)
		reqIDs[i] = NewRequestID()
	}
	keyOf := func(i int) Key { return Key{Consumer: consumer, Kind: s.kind, Key: msgs[i].ID} }

	delay := DefaultBackoff.Initial
	if s.wait != nil {
		delay = s.wait.Initial
	}
	for round := 0; len(pending) > 0; round++ {
		if ctx.Err() != nil {
			for _, i := range pending {
				out[i].Err = contextError(ctx)
			}
			break
		}
		var wait time.Duration
		if round > 0 {
			wait = waitFor(ctx)
		}
		ps := make([]ClaimParams, len(pending))
		for j, i := range pending {
			ps[j] = ClaimParams{Key: keyOf(i), Fingerprint: msgs[i].Fingerprint, Lease: s.lease, Retention: s.retention, RequestID: reqIDs[i], Wait: wait}
		}
		var acquired []int
		var claims []Claim
		var again []int
		retryAfter := time.Duration(0)
		for j, r := range c.claimBatch(ctx, ps, wait, s) {
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
				out[i].Err = &InProgressError{RetryAfter: c.runTimes.retryAfter(consumer, r.Claim.RetryAfter)}
			default:
				out[i].Err = fmt.Errorf("idemreg: unexpected claim outcome %v", r.Claim.Outcome)
			}
		}
		c.runBatch(ctx, s, fn, acquired, claims, keyOf, out)
		pending = again
		// A wait that ended without an outcome is repeated after the
		// backoff (at once when the first round acquired work: that took
		// time of its own), never past the holders' leases.
		if len(pending) > 0 && round > 0 {
			sleep := jitter(delay)
			if retryAfter > 0 && retryAfter < sleep {
				sleep = retryAfter
			}
			if !sleepCtx(ctx, sleep) {
				continue // reported at the top of the loop
			}
			delay = min(2*delay, s.wait.Max)
		}
	}

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
	return out
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
