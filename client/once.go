package client

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Handler does the work of one message for Once. It gets the fencing token
// of its claim in a: make the effect conditional on it (a write fenced with
// "WHERE token < $token", a version check, or the message id recorded in
// the same transaction as the effect), because a holder whose lease ran out
// may still be running when another one takes over.
//
// Return nil (and optionally data, at most about 1 MiB, replayed to
// duplicates) on success, an error marked with Final for an outcome no
// retry can change, and any other error to let the message be retried.
type Handler func(ctx context.Context, a Attempt) (data []byte, err error)

// Attempt is the claim a Handler runs under.
type Attempt struct {
	Key Key
	// Token is the fencing token: larger than the token of every earlier
	// holder of the key.
	Token int64
	// Attempt is 1 for the first holder. Above 1 an earlier holder's lease
	// ran out or was released: it may have done part of the work.
	Attempt int64
}

// OnceResult says what Once did.
type OnceResult struct {
	// Ran: the handler ran in this call.
	Ran bool
	// Replayed: the key was already completed; the stored outcome was
	// returned (its data here, or its failure as the error) and the handler
	// did not run.
	Replayed bool
	// Data is what the handler returned, or what the completed key stored.
	Data []byte
	// Record is the registry's record after the call, when known.
	Record Record
}

// Once runs fn at most once to completion per message id of consumer, and
// gives every duplicate the stored outcome:
//
//   - It claims (consumer, KindMessage, messageID). When acquired it runs fn
//     with the fencing token and extends the lease every half lease while fn
//     runs. Should the registry report that another holder took over, fn's
//     context is cancelled with an error matching ErrLeaseLost as cause
//     (ErrClaimSecretInvalid when the claim outlived a claim key rotation's
//     grace period);
//     should it refuse to extend because the attempt held the key for its
//     consumer's max_lease_total, the cause matches ErrLeaseTotalExceeded
//     (the claim is then released when fn returns, as after an error).
//   - fn returns nil: the outcome (with fn's data) is stored; Ran is true.
//   - fn returns an error marked with Final: the failure is stored and
//     replayed to duplicates; the error is returned.
//   - fn returns any other error (or panics): the claim is released so a
//     redelivery can run fn again; the error is returned (the panic goes on).
//   - The key is already completed: fn does not run; Replayed is true and the
//     stored data is in the result, or the stored failure is the error
//     (IsFinal reports true for it).
//   - Another holder is working on the key: an *InProgressError (ErrInProgress)
//     with the time left on its lease, without running fn; with
//     WithWaitInProgress, Once waits instead for the outcome (or for a
//     takeover when the holder's lease runs out).
//   - The key is parked (its attempts reached the consumer's max_attempts,
//     or a holder parked it with Park): fn does not run; a *ParkedError
//     (ErrParked) with the parked record. Dead-letter or skip the message:
//     it is neither done nor to be retried until an operator resolves it.
//
// A consumer acknowledges its message when err == nil || IsFinal(err), and
// asks for a redelivery otherwise (after InProgressError.RetryAfter for an
// in-progress key).
//
// When fn succeeded but the outcome could not be stored (the registry was
// unreachable for the whole bookkeeping timeout, or another holder took
// over), Ran is true and the error says so: the effect happened, and a
// redelivery after the lease will run fn again with a larger token and an
// Attempt above 1.
//
// Options: WithLease, WithRetention, WithWaitInProgress,
// WithBookkeepingTimeout, WithKind, WithMessageFingerprint, WithResultType.
func (c *Client) Once(ctx context.Context, consumer, messageID string, fn Handler, opts ...OnceOption) (OnceResult, error) {
	s := onceSettings(opts)
	k := Key{Consumer: consumer, Kind: s.kind, Key: messageID}
	cl, err := c.claim(ctx, ClaimParams{Key: k, Fingerprint: s.messageFingerprint, Lease: s.lease, Retention: s.retention}, s)
	if err != nil {
		return OnceResult{Record: cl.Record}, err
	}
	switch cl.Outcome {
	case OutcomeCompleted:
		return replayOnce(cl.Record)
	case OutcomeAcquired:
		return c.runOnce(ctx, k, cl, fn, s)
	default:
		return OnceResult{Record: cl.Record}, fmt.Errorf("idemreg: unexpected claim outcome %v", cl.Outcome)
	}
}

func replayOnce(rec Record) (OnceResult, error) {
	res := OnceResult{Replayed: true, Record: rec}
	switch r := rec.Result; {
	case r == nil:
		return res, fmt.Errorf("%w: completed record without a result", ErrInternal)
	case r.Failure != nil:
		return res, Final(&storedFailure{st: r.Failure})
	default:
		res.Data = r.Response.Data
		return res, nil
	}
}

// storedFailure is a final failure replayed from the registry. Its text is
// the original error's: the status text for a status, the bare message for
// a plain error (stored as UNKNOWN).
type storedFailure struct{ st *status.Status }

func (f *storedFailure) Error() string {
	if f.st.Code() == codes.Unknown {
		return f.st.Message()
	}
	return f.st.Err().Error()
}

func (f *storedFailure) GRPCStatus() *status.Status { return f.st }

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
	params := func(i int, wait time.Duration) ClaimParams {
		return ClaimParams{Key: keyOf(i), Fingerprint: msgs[i].Fingerprint, Lease: s.lease, Retention: s.retention, RequestID: reqIDs[i], Wait: wait}
	}

	var waits *backoff
	if s.wait != nil {
		waits = newBackoff(*s.wait)
	}
	for round := 0; len(pending) > 0; round++ {
		if ctx.Err() != nil {
			for _, i := range pending {
				out[i].Err = contextError(ctx)
			}
			break
		}
		acquired, claims, again, retryAfter := c.batchClaims(ctx, s, pending, round, params, out)
		c.runBatch(ctx, s, fn, acquired, claims, keyOf, out)
		pending = again
		// A wait that ended without an outcome is repeated after the
		// backoff (at once when the first round acquired work: that took
		// time of its own), never past the holders' leases; an ended ctx
		// is reported at the top of the loop.
		if len(pending) > 0 && round > 0 {
			waits.wait(ctx, 0, retryAfter)
		}
	}
	batchDuplicates(msgs, first, out)
	return out
}
