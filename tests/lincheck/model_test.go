package lincheck

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/require"
)

// op is a call on key "k" from client c over [call, ret].
func op(c int, call, ret int64, in Input, out Output) porcupine.Operation {
	if in.Key == "" {
		in.Key = "k"
	}
	return porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret}
}

func claim(fp, holder string) Input { return Input{Method: Claim, Fingerprint: fp, Holder: holder} }
func claimID(fp, holder, rid string) Input {
	return Input{Method: Claim, Fingerprint: fp, Holder: holder, RequestID: rid}
}
func complete(tok int64, res string) Input {
	return Input{Method: Complete, Token: tok, Result: res}
}
func forged(in Input) Input   { in.Forged = true; return in }
func release(tok int64) Input { return Input{Method: Release, Token: tok} }
func extend(tok int64) Input  { return Input{Method: Extend, Token: tok} }
func lookup() Input           { return Input{Method: Lookup} }
func park(tok int64, reason string) Input {
	return Input{Method: Park, Token: tok, Reason: reason}
}
func parkedBy(tok, attempt int64, holder, reason string) Output {
	return Output{Status: OK, Token: tok, Attempt: attempt, Holder: holder, Parked: true, Reason: reason}
}
func parkedClaim(attempt int64, holder, reason string) Output {
	return Output{Status: Parked, Attempt: attempt, Holder: holder, Parked: true, Reason: reason}
}

func acquired(tok, attempt int64, holder string) Output {
	return Output{Status: Acquired, Token: tok, Attempt: attempt, Holder: holder}
}
func inProgress(attempt int64, holder string) Output {
	return Output{Status: InProgress, Attempt: attempt, Holder: holder}
}
func done(tok, attempt int64, holder, res string) Output {
	return Output{Status: OK, Token: tok, Attempt: attempt, Holder: holder, Completed: true, Result: res}
}
func replay(tok, attempt int64, holder, res string) Output {
	o := done(tok, attempt, holder, res)
	o.Status = Completed
	return o
}
func ok(tok, attempt int64, holder string) Output {
	return Output{Status: OK, Token: tok, Attempt: attempt, Holder: holder}
}
func answer(s Status) Output { return Output{Status: s} }

// item makes in item n of batch b; after is the item on its key it
// follows (0: none), followed says a later item follows it.
func item(b string, n, after int, followed bool, in Input) Input {
	in.Batch, in.Item, in.After, in.Followed = b, n, after, followed
	return in
}
func waiting(in Input) Input { in.Wait = 200 * time.Millisecond; return in }

// open is the return time of an ambiguous call: open until the end of the history.
const open = 1 << 40

func TestModel(t *testing.T) {
	cases := []struct {
		name         string
		history      []porcupine.Operation
		linearizable bool
	}{
		{"claim, complete, replay", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(1, 4, 5, claim("A", "h2"), replay(10, 1, "h1", "r1")),
			op(1, 6, 7, claim("B", "h3"), answer(FingerprintMismatch)),
			op(1, 8, 9, lookup(), done(10, 1, "h1", "r1")),
		}, true},
		{"park, then every claim answers parked", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, park(10, "p1"), parkedBy(10, 1, "h1", "p1")),
			op(1, 4, 5, claim("A", "h2"), parkedClaim(1, "h1", "p1")),
			op(1, 6, 7, claim("B", "h3"), answer(FingerprintMismatch)),
			op(0, 8, 9, park(10, "p2"), parkedBy(10, 1, "h1", "p1")),
			op(0, 10, 11, complete(10, "r1"), answer(ParkedRefusal)),
			op(0, 12, 13, release(10), answer(ParkedRefusal)),
			op(1, 14, 15, lookup(), Output{Status: OK, Attempt: 1, Holder: "h1", Parked: true, Reason: "p1"}),
		}, true},
		{"a takeover of a parked key", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, park(10, "p1"), parkedBy(10, 1, "h1", "p1")),
			op(1, 4, 5, claim("A", "h2"), acquired(11, 2, "h2")),
		}, false},
		{"a complete after the park", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, park(10, "p1"), parkedBy(10, 1, "h1", "p1")),
			op(0, 4, 5, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, false},
		{"park of a completed key, and a forged park", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(0, 4, 5, park(10, "p1"), answer(AlreadyCompleted)),
			op(1, 6, 7, forged(park(10, "p2")), answer(SecretInvalid)),
			op(1, 8, 9, claim("A", "h2"), replay(10, 1, "h1", "r1")),
		}, true},
		{"an ambiguous park may have parked the key", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, open, park(10, "p1"), answer(Unknown)),
			op(1, 4, 5, claim("A", "h2"), parkedClaim(1, "h1", "p1")),
		}, true},
		{"two owners at once", []porcupine.Operation{
			op(0, 0, 10, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 0, 10, claim("A", "h2"), acquired(11, 1, "h2")),
		}, false},
		{"a repeat of a lost claim gets its token", []porcupine.Operation{
			op(0, 0, open, claimID("A", "h1", "r1"), answer(Unknown)),
			op(1, 1, 2, claimID("A", "h1", "r1"), acquired(10, 1, "h1")),
			op(1, 3, 4, complete(10, "r"), done(10, 1, "h1", "r")),
		}, true},
		{"a repeat answers the token the first claim got", []porcupine.Operation{
			op(0, 0, 1, claimID("A", "h1", "r1"), acquired(10, 1, "h1")),
			op(1, 2, 3, claimID("A", "h1", "r1"), acquired(11, 1, "h1")),
		}, false},
		{"another request id does not get the token", []porcupine.Operation{
			op(0, 0, 1, claimID("A", "h1", "r1"), acquired(10, 1, "h1")),
			op(1, 2, 3, claimID("A", "h2", "r2"), acquired(10, 1, "h1")),
		}, false},
		{"a repeat after a release is a takeover", []porcupine.Operation{
			op(0, 0, 1, claimID("A", "h1", "r1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, 5, claimID("A", "h1", "r1"), acquired(11, 2, "h1")),
		}, true},
		{"concurrent claims: one owner, the other sees it", []porcupine.Operation{
			op(0, 0, 10, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 0, 10, claim("", "h2"), inProgress(1, "h1")),
		}, true},
		{"in progress names the wrong holder", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 3, claim("A", "h2"), inProgress(1, "h2")),
		}, false},
		{"takeover after release has a larger token and the next attempt", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, 5, claim("A", "h2"), acquired(20, 2, "h2")),
			op(0, 6, 7, complete(10, "stale"), answer(LeaseLost)),
			op(1, 8, 9, complete(20, "r2"), done(20, 2, "h2", "r2")),
		}, true},
		{"a stale holder overwrites", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, 5, claim("A", "h2"), acquired(20, 2, "h2")),
			op(0, 6, 7, complete(10, "stale"), done(10, 2, "h2", "stale")),
		}, false},
		{"tokens go backwards", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, 5, claim("A", "h2"), acquired(9, 2, "h2")),
		}, false},
		{"an acknowledged Complete is lost", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(1, 4, 5, lookup(), ok(0, 1, "h1")),
		}, false},
		{"the first result stays", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(1, 4, 5, complete(10, "r2"), done(10, 1, "h1", "r1")),
		}, true},
		{"a second result replaces the first", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(1, 4, 5, complete(10, "r2"), done(10, 1, "h1", "r2")),
		}, false},
		{"release and extend of a completed key", []porcupine.Operation{
			op(0, 0, 1, claim("", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(0, 4, 5, release(10), answer(AlreadyCompleted)),
			op(0, 6, 7, extend(10), answer(AlreadyCompleted)),
			op(0, 8, 9, release(11), answer(LeaseLost)),
		}, true},
		{"extend revives a released lease", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(0, 4, 5, extend(10), ok(10, 1, "h1")),
			op(1, 6, 7, claim("A", "h2"), inProgress(1, "h1")),
		}, true},
		{"fenced calls on an absent key", []porcupine.Operation{
			op(0, 0, 1, complete(1, "r"), answer(NotFound)),
			op(0, 2, 3, release(1), answer(NotFound)),
			op(0, 4, 5, lookup(), answer(NotFound)),
		}, true},
		{"a forged secret is refused whatever the record", []porcupine.Operation{
			op(0, 0, 1, forged(complete(1, "r")), answer(SecretInvalid)),
			op(0, 2, 3, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 4, 5, forged(complete(10, "intruder")), answer(SecretInvalid)),
			op(1, 6, open, forged(release(10)), answer(Unknown)),
			op(0, 8, 9, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, true},
		{"the holder's own secret refused as invalid", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), answer(SecretInvalid)),
		}, false},
		{"a forged call told LEASE_LOST (another holder) instead of CLAIM_SECRET_INVALID", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 3, forged(complete(10, "intruder")), answer(LeaseLost)),
		}, false},
		{"a forged Complete takes effect", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 3, forged(complete(10, "intruder")), done(10, 1, "h1", "intruder")),
		}, false},
		{"an ambiguous forged Release frees the key", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, open, forged(release(10)), answer(Unknown)),
			op(2, 4, 5, claim("A", "h2"), acquired(20, 2, "h2")),
		}, false},
		{"a takeover keeps the stored fingerprint or records one", []porcupine.Operation{
			op(0, 0, 1, claim("", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, 5, claim("B", "h2"), acquired(20, 2, "h2")),
			op(2, 6, 7, claim("A", "h3"), answer(FingerprintMismatch)),
		}, true},
		{"an ambiguous Claim may have acquired", []porcupine.Operation{
			op(0, 0, open, claim("A", "h1"), answer(Unknown)),
			op(1, 2, 3, claim("A", "h2"), inProgress(1, "h1")),
			op(1, 4, 5, complete(7, "r"), answer(LeaseLost)),
		}, true},
		{"an ambiguous Claim may not have acquired", []porcupine.Operation{
			op(0, 0, open, claim("A", "h1"), answer(Unknown)),
			op(1, 2, 3, claim("A", "h2"), acquired(10, 1, "h2")),
		}, true},
		{"a token acquired after an ambiguous takeover is larger than the last one seen", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, release(10), ok(10, 1, "h1")),
			op(1, 4, open, claim("A", "h2"), answer(Unknown)),
			op(2, 6, 7, claim("A", "h3"), acquired(10, 2, "h3")),
		}, false},
		{"an ambiguous Complete applies once and stays", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, open, complete(10, "r1"), answer(Unknown)),
			op(1, 4, 5, lookup(), ok(0, 1, "h1")),
			op(1, 6, 7, lookup(), done(10, 1, "h1", "r1")),
			op(1, 8, 9, lookup(), done(10, 1, "h1", "r1")),
		}, true},
		{"an ambiguous Complete does not come undone", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, open, complete(10, "r1"), answer(Unknown)),
			op(1, 4, 5, lookup(), done(10, 1, "h1", "r1")),
			op(1, 6, 7, lookup(), ok(0, 1, "h1")),
		}, false},

		// A batch: each item is its own call over the batch's interval.
		{"batch claim of a key twice: the second sees the first", []porcupine.Operation{
			op(0, 0, 10, item("b1", 1, 0, true, claim("A", "h1")), acquired(10, 1, "h1")),
			op(1, 0, 10, item("b1", 2, 1, false, claim("A", "h2")), inProgress(1, "h1")),
		}, true},
		{"batch claim of a key twice decided in the wrong order", []porcupine.Operation{
			op(0, 0, 10, item("b1", 1, 0, true, claim("A", "h1")), inProgress(1, "h2")),
			op(1, 0, 10, item("b1", 2, 1, false, claim("A", "h2")), acquired(10, 1, "h2")),
		}, false},
		{"the same answers from two unary claims at once are linearizable", []porcupine.Operation{
			op(0, 0, 10, claim("A", "h1"), inProgress(1, "h2")),
			op(1, 0, 10, claim("A", "h2"), acquired(10, 1, "h2")),
		}, true},
		{"batch complete of a key twice: the first result stays", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 5, item("b2", 1, 0, true, complete(10, "r1")), done(10, 1, "h1", "r1")),
			op(1, 2, 5, item("b2", 2, 1, false, complete(10, "r2")), done(10, 1, "h1", "r1")),
		}, true},
		{"batch complete of a key twice decided in the wrong order", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 5, item("b2", 1, 0, true, complete(10, "r1")), done(10, 1, "h1", "r2")),
			op(1, 2, 5, item("b2", 2, 1, false, complete(10, "r2")), done(10, 1, "h1", "r2")),
		}, false},
		{"batch items are not atomic: another call between two items on a key", []porcupine.Operation{
			op(0, 0, 10, item("b3", 1, 0, true, claim("A", "h1")), acquired(10, 1, "h1")),
			op(2, 1, 2, lookup(), ok(0, 1, "h1")),
			op(2, 3, 4, forged(release(10)), answer(SecretInvalid)),
			op(1, 0, 10, item("b3", 2, 1, false, claim("A", "h2")), inProgress(1, "h1")),
		}, true},
		{"batch items on other keys do not order each other", []porcupine.Operation{
			op(0, 0, 10, item("b4", 1, 0, false, Input{Method: Claim, Key: "k1", Fingerprint: "A", Holder: "h1"}), inProgress(1, "h0")),
			op(0, 0, 10, item("b4", 2, 0, false, Input{Method: Claim, Key: "k2", Fingerprint: "A", Holder: "h2"}), acquired(10, 1, "h2")),
			op(1, 0, 1, Input{Method: Claim, Key: "k1", Fingerprint: "A", Holder: "h0"}, acquired(5, 1, "h0")),
		}, true},
		{"a batch item acquires what another batch item acquired", []porcupine.Operation{
			op(0, 0, 10, item("b5", 1, 0, false, claim("A", "h1")), acquired(10, 1, "h1")),
			op(1, 0, 10, item("b6", 1, 0, false, claim("A", "h2")), acquired(11, 1, "h2")),
		}, false},
		{"an ambiguous batch: the first item may not have been applied", []porcupine.Operation{
			op(0, 0, open, item("b7", 1, 0, true, claim("A", "h1")), answer(Unknown)),
			op(0, 0, open, item("b7", 2, 1, false, claim("A", "h2")), answer(Unknown)),
			op(1, 2, 3, lookup(), ok(0, 1, "h2")),
		}, true},
		{"an ambiguous batch complete: an item's failure is its own", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, open, item("b8", 1, 0, true, complete(10, "r1")), answer(Unknown)),
			op(0, 2, open, item("b8", 2, 1, false, complete(10, "r2")), answer(Unknown)),
			op(1, 4, 5, lookup(), done(10, 1, "h1", "r2")),
		}, true},
		{"an acknowledged batch complete's first result stays", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 5, item("b9", 1, 0, true, complete(10, "r1")), done(10, 1, "h1", "r1")),
			op(0, 2, open, item("b9", 2, 1, false, complete(10, "r2")), answer(Unknown)),
			op(1, 6, 7, lookup(), done(10, 1, "h1", "r2")),
		}, false},

		// The server decides a waiting item again after its wait, after the
		// later items on its key: the workload orders no items after one
		// that waits, and this is why.
		{"a waiting batch item takes over after the next item on its key", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h0"), acquired(10, 1, "h0")),
			op(1, 2, 10, item("b10", 1, 0, false, waiting(claim("A", "h1"))), acquired(11, 2, "h1")),
			op(2, 2, 10, item("b10", 2, 0, false, claim("A", "h2")), inProgress(1, "h0")),
			op(0, 4, 5, release(10), ok(10, 1, "h0")),
		}, true},
		{"the same answers ordered in batch order are rejected", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h0"), acquired(10, 1, "h0")),
			op(1, 2, 10, item("b11", 1, 0, true, waiting(claim("A", "h1"))), acquired(11, 2, "h1")),
			op(2, 2, 10, item("b11", 2, 1, false, claim("A", "h2")), inProgress(1, "h0")),
			op(0, 4, 5, release(10), ok(10, 1, "h0")),
		}, false},

		// A waiting Claim: one Claim over the whole wait.
		{"a waiter sees the Complete made while it waits", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), replay(10, 1, "h1", "r1")),
			op(0, 4, 5, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, true},
		{"a waiter takes over a lease released while it waits", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), acquired(11, 2, "h2")),
			op(0, 4, 5, release(10), ok(10, 1, "h1")),
			op(0, 11, 12, complete(10, "late"), answer(LeaseLost)),
		}, true},
		{"a waiter whose wait elapsed answers in progress", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), inProgress(1, "h1")),
			op(0, 11, 12, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, true},
		{"a waiter takes over a lease nobody released", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), acquired(11, 2, "h2")),
			op(0, 11, 12, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, false},
		{"a waiter takes over a lease released only after it answered", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), acquired(11, 2, "h2")),
			op(0, 11, 12, release(10), ok(10, 1, "h1")),
		}, false},
		{"a waiter replays a result stored only after it answered", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(1, 2, 10, waiting(claim("A", "h2")), replay(10, 1, "h1", "r1")),
			op(0, 11, 12, complete(10, "r1"), done(10, 1, "h1", "r1")),
		}, false},
		{"a waiter in progress after the Complete returned", []porcupine.Operation{
			op(0, 0, 1, claim("A", "h1"), acquired(10, 1, "h1")),
			op(0, 2, 3, complete(10, "r1"), done(10, 1, "h1", "r1")),
			op(1, 4, 10, waiting(claim("A", "h2")), inProgress(1, "h1")),
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := porcupine.CheckOperationsTimeout(Model, tc.history, 10*time.Second)
			want := porcupine.Illegal
			if tc.linearizable {
				want = porcupine.Ok
			}
			require.Equal(t, want, got)
		})
	}
}

func TestCheckWritesVisualisation(t *testing.T) {
	history := []porcupine.Operation{
		op(0, 0, 10, claim("A", "h1"), acquired(10, 1, "h1")),
		op(1, 0, 10, claim("A", "h2"), acquired(11, 1, "h2")),
	}
	path := t.TempDir() + "/history.html"
	err := Check(history, 10*time.Second, path)
	require.ErrorIs(t, err, ErrNotLinearizable)
	require.FileExists(t, path)
	require.NoError(t, Check(history[:1], 10*time.Second, path))
}

func TestHistoryOpensAmbiguousCalls(t *testing.T) {
	r := NewRecorder()
	c := r.NewClient()
	r.Add(c, claim("A", "h"), 5, answer(Unknown), 6)
	r.Add(c, lookup(), 7, answer(Unknown), 8)
	r.Add(c, complete(1, "r"), 7, answer(Unknown), 8)
	r.Add(c, lookup(), 9, answer(NotFound), 10)
	h, st := r.History()
	require.Len(t, h, 2, "an ambiguous Lookup, and a Complete with a token nobody acquired, are left out")
	require.Equal(t, int64(11), h[0].Return, "an ambiguous call is open to the end")
	require.Equal(t, 1, st.Ambiguous)

	r = NewRecorder()
	r.Add(c, claim("A", "h"), 0, answer(Unknown), 1)
	r.Barrier()
	r.Add(c, claim("A", "h2"), r.Now(), acquired(10, 1, "h2"), r.Now())
	h, _ = r.History()
	require.Less(t, h[0].Return, h[1].Call, "an ambiguous call before a barrier is closed there")
}
