package client

import (
	"context"
	"errors"
	"fmt"

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

func (c *Client) runOnce(ctx context.Context, k Key, cl Claim, fn Handler, s *settings) (OnceResult, error) {
	h := heldOf(k, cl)
	var data []byte
	var fnErr error
	d, lost := c.runHeld(ctx, s, h, func(ctx context.Context) decision {
		data, fnErr = fn(ctx, Attempt{Key: k, Token: h.fence.Token, Attempt: h.attempt})
		d := handlerDecision(data, fnErr)
		if d.result.Response != nil {
			d.result.Response.Type = s.resultType
		}
		return d
	})
	recs, errs := c.settle(ctx, s, []held{h}, []decision{d}, []error{lost})
	return ranOutcome(cl.Record, data, fnErr, d, recs[0], errs[0])
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
