// Package lincheck checks histories of calls to a real idemreg registry for
// linearizability with porcupine. It owns the model of the registry's
// contract (docs/semantics.md, storage/rules.go) at the API level, the
// recorder that turns concurrent gRPC calls into a porcupine history, and
// the workload that produces such histories; the fault-injecting harness
// that drives them lives in tests/faults' linearizability tests.
//
// The model assumes leases and retention long relative to a run: no lease
// runs out and no record expires while a history is recorded, so a lease
// ends only by Release and starts again only by Claim or Extend. Lease
// expiry and record expiry are checked by the conformance suite
// (storage/storagetest) with a clock it moves, not here.
//
// Batches and waits add no kind of operation. Each item of a BatchClaim
// or BatchComplete is its own Claim or Complete, over the batch call's
// whole interval: a batch is not atomic. Items on one key in one batch are
// decided in their order, which intervals alone cannot say (they share
// one), so an item carries the batch and its position, and the model only
// takes it after the item on its key before it (State.Marks). A Claim
// with a wait is one Claim over an interval that spans the wait: whatever
// it answers (completed, acquired by a takeover, in progress) must be the
// answer of a Claim at one point of that interval, which is what the
// model checks for every Claim. That the waiter answered soon after the
// change that woke it is not a linearizability property; the bench
// measures it.
package lincheck

import (
	"fmt"
	"hash/fnv"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Method is a registry RPC.
type Method uint8

// The RPCs of idemreg.v1.RegistryService.
const (
	Claim Method = iota + 1
	Complete
	Release
	Extend
	Lookup
	Park
)

func (m Method) String() string {
	switch m {
	case Claim:
		return "Claim"
	case Complete:
		return "Complete"
	case Release:
		return "Release"
	case Extend:
		return "Extend"
	case Lookup:
		return "Lookup"
	case Park:
		return "Park"
	}
	return fmt.Sprintf("Method(%d)", m)
}

// Input is one call: the RPC, its key (the partition: every call names one
// key, and keys are independent), and the arguments the model needs.
type Input struct {
	Method Method
	Key    string
	// Token of Complete, Release and Extend.
	Token int64
	// Forged: the call's claim secret is not its token's (a caller that
	// knows or guessed the token but did not acquire it).
	Forged bool
	// Fingerprint, Holder and RequestID of Claim.
	Fingerprint, Holder, RequestID string
	// Result of Complete: an identity unique to the call.
	Result string
	// Reason of Park: an identity unique to the call.
	Reason string
	// Wait of Claim: how long it may wait while another holder's lease is
	// live. The model does not read it (see the package doc).
	Wait time.Duration
	// Batch names the BatchClaim or BatchComplete call the item is part
	// of ("" for a unary call), Item is its position there (from 1).
	Batch string
	Item  int
	// After is the position of the item on the same key before this one in
	// the batch (0: none); the model takes this item only after that one.
	// Followed says that a later item of the batch names this one in After.
	After    int
	Followed bool
}

// mark names a batch item that a later item on its key must follow.
func mark(batch string, item int) string { return batch + "#" + strconv.Itoa(item) }

// Status is what a call answered.
type Status uint8

// Answers. Unknown is an ambiguous failure (a timeout, a cut connection, an
// unavailable store): the call may or may not have taken effect.
const (
	Unknown Status = iota
	OK
	Acquired
	InProgress
	Completed
	NotFound
	LeaseLost
	AlreadyCompleted
	FingerprintMismatch
	// Parked is a Claim's OUTCOME_PARKED; ParkedRefusal is a Complete,
	// Release or Extend refused with PARKED.
	Parked
	ParkedRefusal
	// SecretInvalid is a Complete, Release, Extend or Park refused with
	// CLAIM_SECRET_INVALID: the secret is not its token's. Only a forged
	// call may get it.
	SecretInvalid
)

func (s Status) String() string {
	return [...]string{"UNKNOWN", "OK", "ACQUIRED", "IN_PROGRESS", "COMPLETED", "NOT_FOUND",
		"LEASE_LOST", "ALREADY_COMPLETED", "FINGERPRINT_MISMATCH", "PARKED", "PARKED_REFUSAL", "CLAIM_SECRET_INVALID"}[s]
}

// Output is what a call returned, as far as the model checks it.
type Output struct {
	Status Status
	// Token: the acquired token (Claim), or the record's token where the
	// API shows it (a completed record, and the caller's own record after
	// Complete, Release and Extend).
	Token int64
	// The record returned with the answer.
	Attempt   int64
	Holder    string
	Completed bool
	Result    string
	// Parked and its ParkReason, as the record shows them.
	Parked bool
	Reason string
}

// State is the model of one key. Its zero value is an absent key. It is
// comparable, so porcupine compares states with ==.
type State struct {
	Exists    bool
	Completed bool
	// LeaseLive: in progress and the lease has not been released.
	LeaseLive bool
	// Token is the current token when TokenKnown; otherwise the current
	// token was issued to a call that failed ambiguously, nobody learned it,
	// and Token is a lower bound: the current token is larger.
	Token       int64
	TokenKnown  bool
	Attempt     int64
	Holder      string
	Fingerprint string
	Result      string
	// Parked: its holder parked it (Park) with Reason; nobody holds it, and
	// every Claim answers parked. The workload sets no max_attempts, so
	// only Park parks a record here; parking by a Claim at max_attempts
	// needs lease expiry, which the conformance suite checks.
	Parked bool
	Reason string
	// RequestID is the request id of the Claim that acquired the lease.
	RequestID string
	// Marks are the batch items taken whose follower on the key is not
	// yet (mark, sorted, comma-separated: State must stay comparable).
	Marks string
}

func (s State) hasMark(m string) bool { return slices.Contains(strings.Split(s.Marks, ","), m) }

func (s State) withMarks(add, remove string) State {
	var ms []string
	for _, m := range strings.Split(s.Marks, ",") {
		if m != "" && m != remove {
			ms = append(ms, m)
		}
	}
	if add != "" {
		ms = append(ms, add)
	}
	sort.Strings(ms)
	s.Marks = strings.Join(ms, ",")
	return s
}

func (s State) String() string {
	var b strings.Builder
	if s.Marks != "" {
		fmt.Fprintf(&b, "[after %s] ", s.Marks)
	}
	if !s.Exists {
		b.WriteString("absent")
		return b.String()
	}
	switch {
	case s.Completed:
		fmt.Fprintf(&b, "completed %q", s.Result)
	case s.Parked:
		fmt.Fprintf(&b, "parked %q", s.Reason)
	case s.LeaseLive:
		b.WriteString("in progress")
	default:
		b.WriteString("released")
	}
	if s.TokenKnown {
		fmt.Fprintf(&b, " t=%d", s.Token)
	} else {
		fmt.Fprintf(&b, " t>%d", s.Token)
	}
	fmt.Fprintf(&b, " a=%d h=%s fp=%q rid=%q", s.Attempt, s.Holder, s.Fingerprint, s.RequestID)
	return b.String()
}

func fingerprintsConflict(stored, given string) bool {
	return stored != "" && given != "" && stored != given
}

// step returns the states the key can be in after the call in has answered
// out in state s; none when that answer is impossible. An Unknown answer
// allows both the state before and the state after the call. A batch item
// that must follow another is impossible before it.
func step(s State, in Input, out Output) []State {
	var before string
	if in.After > 0 {
		before = mark(in.Batch, in.After)
		if !s.hasMark(before) {
			return nil
		}
	}
	var follow string
	if in.Followed {
		follow = mark(in.Batch, in.Item)
	}
	// The marks are the batches' bookkeeping, not the record's: the call
	// is decided on the record alone, and the marks carried over.
	marks := s.Marks
	s.Marks = ""
	next := stepCall(s, in, out)
	for i := range next {
		next[i].Marks = marks
		next[i] = next[i].withMarks(follow, before)
	}
	return next
}

func stepCall(s State, in Input, out Output) []State {
	keep := []State{s}
	switch in.Method {
	case Claim:
		return stepClaim(s, in, out)
	case Lookup:
		switch {
		case out.Status == Unknown:
			return keep
		case !s.Exists:
			return when(out.Status == NotFound, s)
		}
		ok := out.Status == OK && out.Completed == s.Completed && out.Attempt == s.Attempt && out.Holder == s.Holder &&
			out.Parked == s.Parked && out.Reason == s.Reason
		if s.Completed {
			ok = ok && out.Token == s.Token && out.Result == s.Result
		}
		return when(ok, s)
	}

	// Complete, Release and Extend are fenced by the claim secret first:
	// without its token's, nothing happens and the answer is
	// CLAIM_SECRET_INVALID, whether or not the key exists; a call with its
	// token's secret never gets that answer.
	if in.Forged {
		return when(out.Status == Unknown || out.Status == SecretInvalid, s)
	}
	if out.Status == SecretInvalid {
		return nil
	}
	// Then by the token: an absent key is NOT_FOUND, another token
	// LEASE_LOST. A token nobody learned is never presented, so it never
	// matches.
	switch {
	case out.Status == Unknown && (!s.Exists || !s.TokenKnown || s.Token != in.Token):
		return keep
	case !s.Exists:
		return when(out.Status == NotFound, s)
	case !s.TokenKnown || s.Token != in.Token:
		return when(out.Status == LeaseLost, s)
	}
	answered := func(next State) bool {
		return out.Status == OK && out.Token == in.Token && out.Attempt == next.Attempt &&
			out.Holder == next.Holder && out.Completed == next.Completed && out.Result == next.Result &&
			out.Parked == next.Parked && out.Reason == next.Reason
	}
	next := s
	if s.Parked && in.Method != Park {
		// Nothing but an operator changes a parked record.
		return when(out.Status == Unknown || out.Status == ParkedRefusal, s)
	}
	switch in.Method {
	case Park:
		switch {
		case s.Completed:
			return when(out.Status == Unknown || out.Status == AlreadyCompleted, s)
		case s.Parked:
			// A repeat returns the parked record: the first reason stays.
			return when(out.Status == Unknown || answered(s), s)
		}
		next.Parked, next.LeaseLive, next.Reason = true, false, in.Reason
	case Complete:
		if s.Completed {
			// A repeated Complete with the current token returns the
			// stored record: the first result stays.
			return when(out.Status == Unknown || answered(s), s)
		}
		next.Completed, next.LeaseLive, next.Result = true, false, in.Result
	case Release, Extend:
		if s.Completed {
			return when(out.Status == Unknown || out.Status == AlreadyCompleted, s)
		}
		next.LeaseLive = in.Method == Extend
	default:
		return nil
	}
	if out.Status == Unknown {
		return []State{s, next}
	}
	return when(answered(next), next)
}

func stepClaim(s State, in Input, out Output) []State {
	acquire := func(next State) []State {
		next.Exists, next.Completed, next.LeaseLive = true, false, true
		next.Holder, next.RequestID = in.Holder, in.RequestID
		next.Result = ""
		if out.Status == Unknown {
			// Acquired by a caller that never learned its token: the token
			// grew, to a value nobody can present.
			next.TokenKnown = false
			next.Token = s.Token
			return []State{s, next}
		}
		// Tokens of a key strictly increase, also past a token nobody
		// learned (s.Token is then its lower bound).
		if out.Status != Acquired || out.Token <= s.Token || out.Attempt != next.Attempt {
			return nil
		}
		next.Token, next.TokenKnown = out.Token, true
		return []State{next}
	}
	if !s.Exists {
		return acquire(State{Token: s.Token, Attempt: 1, Fingerprint: in.Fingerprint})
	}
	if fingerprintsConflict(s.Fingerprint, in.Fingerprint) {
		return when(out.Status == Unknown || out.Status == FingerprintMismatch, s)
	}
	switch {
	case s.Parked:
		// Parked until an operator resolves it: no token, no takeover.
		return when(out.Status == Unknown || out.Status == Parked && out.Attempt == s.Attempt &&
			out.Holder == s.Holder && out.Reason == s.Reason && out.Token == 0, s)
	case s.LeaseLive && in.RequestID != "" && in.RequestID == s.RequestID:
		// A repeat of the Claim that acquired the live lease: the same
		// answer, and the caller learns the token even if the first
		// answer was lost.
		if out.Status == Unknown {
			return []State{s}
		}
		if out.Status != Acquired || out.Attempt != s.Attempt || out.Holder != s.Holder ||
			(s.TokenKnown && out.Token != s.Token) || (!s.TokenKnown && out.Token <= s.Token) {
			return nil
		}
		next := s
		next.Token, next.TokenKnown = out.Token, true
		return []State{next}
	case out.Status == Unknown && (s.Completed || s.LeaseLive):
		return []State{s}
	case s.Completed:
		return when(out.Status == Completed && s.TokenKnown && out.Token == s.Token &&
			out.Result == s.Result && out.Attempt == s.Attempt && out.Holder == s.Holder, s)
	case s.LeaseLive:
		// One owner at a time: the live holder is the one the model knows.
		return when(out.Status == InProgress && out.Attempt == s.Attempt && out.Holder == s.Holder, s)
	}
	// Takeover of a released lease.
	next := s
	next.Attempt++
	if next.Fingerprint == "" {
		next.Fingerprint = in.Fingerprint
	}
	return acquire(next)
}

func when(ok bool, s State) []State {
	if ok {
		return []State{s}
	}
	return nil
}

func (in Input) String() string {
	if in.Batch != "" {
		s := fmt.Sprintf("Batch%s[%s #%d", in.Method, in.Batch, in.Item)
		if in.After > 0 {
			s += fmt.Sprintf(" after #%d", in.After)
		}
		return s + "] " + in.call()
	}
	return in.call()
}

func (in Input) call() string {
	switch in.Method {
	case Claim:
		if in.Wait > 0 {
			return fmt.Sprintf("Claim(fp=%q, h=%s, rid=%s, wait=%v)", in.Fingerprint, in.Holder, in.RequestID, in.Wait)
		}
		return fmt.Sprintf("Claim(fp=%q, h=%s, rid=%s)", in.Fingerprint, in.Holder, in.RequestID)
	case Complete:
		return fmt.Sprintf("Complete(t=%d%s, %q)", in.Token, forgedMark(in), in.Result)
	case Release, Extend:
		return fmt.Sprintf("%s(t=%d%s)", in.Method, in.Token, forgedMark(in))
	case Park:
		return fmt.Sprintf("Park(t=%d%s, %q)", in.Token, forgedMark(in), in.Reason)
	}
	return in.Method.String() + "()"
}

func forgedMark(in Input) string {
	if in.Forged {
		return ", forged"
	}
	return ""
}

func (out Output) String() string {
	switch out.Status {
	case Unknown, NotFound, LeaseLost, AlreadyCompleted, FingerprintMismatch, ParkedRefusal, SecretInvalid:
		return out.Status.String()
	}
	s := fmt.Sprintf("%s t=%d a=%d h=%s", out.Status, out.Token, out.Attempt, out.Holder)
	if out.Completed {
		s += fmt.Sprintf(" completed %q", out.Result)
	}
	if out.Parked {
		s += fmt.Sprintf(" parked %q", out.Reason)
	}
	return s
}

// Model is the registry's contract as a porcupine model, partitioned by key.
var Model = (&porcupine.NondeterministicModel{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		for _, op := range history {
			k := op.Input.(Input).Key
			byKey[k] = append(byKey[k], op)
		}
		keys := make([]string, 0, len(byKey))
		for k := range byKey {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([][]porcupine.Operation, 0, len(keys))
		for _, k := range keys {
			parts = append(parts, byKey[k])
		}
		return parts
	},
	Init: func() []any { return []any{State{}} },
	Step: func(state, input, output any) []any {
		next := step(state.(State), input.(Input), output.(Output))
		out := make([]any, len(next))
		for i, s := range next {
			out[i] = s
		}
		return out
	},
	Hash: func(state any) uint64 {
		h := fnv.New64a()
		fmt.Fprintf(h, "%v", state.(State))
		return h.Sum64()
	},
	DescribeOperation: func(input, output any) string {
		return input.(Input).String() + " → " + output.(Output).String()
	},
	DescribeState: func(state any) string { return state.(State).String() },
}).ToModel()
