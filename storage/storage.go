// Package storage defines what idemreg keeps and the rules it keeps it by.
//
// It owns the record types, the Store interface every backend implements,
// the errors a Store returns, and the registry's state machine (rules.go):
// the one description of what Claim, Complete, Release, Extend and Lookup
// decide for a given stored record at a given instant of the store's clock.
// Backends execute those decisions atomically; they do not invent their own.
//
// storage imports no gRPC: the server translates these errors to statuses.
package storage

import (
	"context"
	"errors"
	"time"
)

// Kind says what a key names.
type Kind uint8

const (
	// KindMessage is a broker message id de-duplicated by an inbox-style consumer.
	KindMessage Kind = 1
	// KindOperation is an idempotency key for an operation, such as an external call.
	KindOperation Kind = 2
)

// Valid reports whether k is a known kind.
func (k Kind) Valid() bool { return k == KindMessage || k == KindOperation }

// State is the state of a stored record.
type State uint8

const (
	// StateInProgress: the holder of the current token is working on the key.
	StateInProgress State = 1
	// StateCompleted: the record holds the result to replay.
	StateCompleted State = 2
	// StateParked: the key may not be done again until an operator resolves
	// it (Invalidate): its attempts ran out (ClaimParams.MaxAttempts), or
	// its holder parked it because the outcome of its work is unknown.
	StateParked State = 3
)

// Outcome is the answer to a Claim.
type Outcome uint8

const (
	// OutcomeAcquired: the caller owns the key with the record's token.
	OutcomeAcquired Outcome = 1
	// OutcomeInProgress: another holder's lease is live.
	OutcomeInProgress Outcome = 2
	// OutcomeCompleted: the record holds the result to replay.
	OutcomeCompleted Outcome = 3
	// OutcomeParked: the record is parked; the caller must not do the work.
	OutcomeParked Outcome = 4
)

// Key identifies a record.
type Key struct {
	Consumer string
	Kind     Kind
	Key      string
}

// Record is a stored key. Times are the store's clock.
type Record struct {
	Key
	State State
	// Fingerprint is empty when none was given.
	Fingerprint []byte
	// Token is the current fencing token; tokens of one key strictly increase.
	Token int64
	// Attempt counts acquisitions since the record was created.
	Attempt int64
	Holder  string
	// Lease is the length of the current lease, as the Claim that acquired
	// it or the last Extend set it. An Extend without a lease extends by
	// it. Zero when nobody holds the current token (an operator's
	// Invalidate or Resolve issued it), and for a record written before
	// records kept it.
	Lease time.Duration
	// RequestID is the request_id of the Claim that acquired the current
	// lease, empty when it sent none; a repeat of that Claim while the
	// lease is live is answered with this record.
	RequestID      string
	CreatedAt      time.Time
	LeaseExpiresAt time.Time
	// CompletedAt is zero while in progress.
	CompletedAt time.Time
	// ExpiresAt is when the record starts to count as absent.
	ExpiresAt time.Time
	// Retention is how long the record is kept after its lease or its
	// completion; Complete applies it.
	Retention time.Duration
	// Result is the encoded result, opaque to storage; set when completed.
	Result []byte
	// ParkReason says why the record is parked: the holder's reason given
	// to Park, or ParkReasonMaxAttempts. Empty unless parked.
	ParkReason string
	// History is the record's last ended attempts, oldest first, at most
	// MaxHistory (DecideClaim's takeover, DecideInvalidate and
	// DecideResolve append to it). Only Admin's Inspect and List return
	// it; the answers of the other methods leave it nil.
	History []Attempt
	// Waiters are the replicas (storage.Membership IDs) that marked the
	// record (WaitMarker) for a Claim waiting for the attempt a call
	// ended, so that the server tells them. Only the answers of the calls
	// that end an attempt (Complete, Release, Park, Admin's Invalidate and
	// Resolve, and batched Completes) carry them, and only when the call
	// wrote; nil elsewhere, and always on a store that keeps no marks. A
	// hint: a replica named may have no waiter left.
	Waiters []string
}

// ParkReasonMaxAttempts is the ParkReason of a record a Claim parked
// because its attempts had reached ClaimParams.MaxAttempts.
const ParkReasonMaxAttempts = "max_attempts reached"

// ClaimParams are the arguments of Store.Claim. Lease and Retention are
// positive; the server applies defaults and bounds before calling.
type ClaimParams struct {
	Key
	Fingerprint []byte
	Lease       time.Duration
	Retention   time.Duration
	Holder      string
	// RequestID, when not empty, identifies this claim across repeats:
	// see DecideClaim.
	RequestID string
	// MaxAttempts, when positive, bounds the acquisitions of a record: a
	// Claim that would take over a record whose Attempt has reached it
	// parks the record instead (DecideClaim). Zero means no bound.
	MaxAttempts int64
}

// ClaimResult is the answer of Store.Claim.
type ClaimResult struct {
	Outcome Outcome
	// Record is the record after the claim: the caller's own when acquired,
	// the other holder's when in progress, the completed one when completed.
	Record Record
	// RetryAfter is what is left of the holder's lease when in progress.
	RetryAfter time.Duration
	// Repeated is set when the answer is a repeat of the Claim that holds
	// the lease (same RequestID): acquired, but nothing was written.
	Repeated bool
}

// CompleteParams are the arguments of Store.Complete.
type CompleteParams struct {
	Key
	Token  int64
	Result []byte
}

// ReleaseParams are the arguments of Store.Release.
type ReleaseParams struct {
	Key
	Token int64
}

// ParkParams are the arguments of Store.Park. Reason is not empty.
type ParkParams struct {
	Key
	Token  int64
	Reason string
}

// ExtendParams are the arguments of Store.Extend. Lease is positive.
type ExtendParams struct {
	Key
	Token int64
	// Lease is the new lease, counted from now; zero means the record's
	// own (Record.Lease), or DefaultLease for a record that has none.
	Lease        time.Duration
	DefaultLease time.Duration
	// MaxLeaseTotal, when positive, bounds how long one attempt may hold
	// the key: the lease may not run past LeaseNotAfter. Zero means no
	// bound.
	MaxLeaseTotal time.Duration
}

// Store keeps records. Every method is atomic per key and safe for
// concurrent use by many processes sharing the same backend. Every time
// comparison uses the store's clock.
type Store interface {
	// Claim decides by DecideClaim. Errors: ErrFingerprintMismatch,
	// ErrExhausted (a store short of a resource may refuse a Claim that
	// would start an attempt), ErrUnavailable.
	Claim(ctx context.Context, p ClaimParams) (ClaimResult, error)
	// Complete decides by DecideComplete and returns the stored record.
	// Errors: ErrNotFound, ErrLeaseLost, ErrParked, ErrExhausted (a large
	// result, on a store short of space), ErrUnavailable.
	Complete(ctx context.Context, p CompleteParams) (Record, error)
	// Release decides by DecideRelease. Errors: ErrNotFound, ErrLeaseLost,
	// ErrAlreadyCompleted, ErrParked, ErrUnavailable.
	Release(ctx context.Context, p ReleaseParams) (Record, error)
	// Extend decides by DecideExtend. Errors: ErrNotFound, ErrLeaseLost,
	// ErrAlreadyCompleted, ErrParked, ErrLeaseTotalExceeded, ErrUnavailable.
	Extend(ctx context.Context, p ExtendParams) (Record, error)
	// Park decides by DecidePark and returns the stored record. Errors:
	// ErrNotFound, ErrLeaseLost, ErrAlreadyCompleted, ErrUnavailable.
	Park(ctx context.Context, p ParkParams) (Record, error)
	// Lookup returns the live record. Errors: ErrNotFound, ErrUnavailable.
	Lookup(ctx context.Context, k Key) (Record, error)
	// Ping reports whether the store can serve requests.
	Ping(ctx context.Context) error
	// Close releases the store's resources.
	Close() error
}

// Errors returned by a Store. Backends wrap driver errors in ErrUnavailable
// (with %w, so the cause stays inspectable for logs) and return the others
// as they are.
var (
	// ErrNotFound: no live record (absent, or expired whether swept or not).
	ErrNotFound = errors.New("record not found")
	// ErrLeaseLost: the token is not the record's current token.
	ErrLeaseLost = errors.New("lease lost: token is not current")
	// ErrAlreadyCompleted: Release, Extend or Park of a completed record.
	ErrAlreadyCompleted = errors.New("record already completed")
	// ErrParked: Complete, Release or Extend of a parked record.
	ErrParked = errors.New("record parked")
	// ErrLeaseTotalExceeded: the Extend would hold the lease past
	// LeaseNotAfter; the lease in force is unchanged.
	ErrLeaseTotalExceeded = errors.New("the lease would run past the most one attempt may hold the key")
	// ErrFingerprintMismatch: the key is live with another fingerprint.
	ErrFingerprintMismatch = errors.New("fingerprint mismatch")
	// ErrUnavailable: the store could not answer (down, or conflicts
	// outlasted the retries, or it failed for good: see Failing). Safe to
	// retry.
	ErrUnavailable = errors.New("store unavailable")
	// ErrExhausted: the store is short of a resource of its machine or
	// database and refused a call that would need more of it; nothing was
	// written. The error is an *ExhaustedError naming the resource. Safe
	// to retry once the resource is back, not at once.
	ErrExhausted = errors.New("store resources exhausted")
)

// Resource names what an *ExhaustedError ran short of.
type Resource string

// The resources a store (or the server in front of it) can run short of.
const (
	// ResourceDisk: the embedded store's file system is below its reserve,
	// or the database's disk is full (SQLSTATE 53100).
	ResourceDisk Resource = "disk"
	// ResourceMemory: the database is out of memory (53200), or the
	// server's heap is near its limit.
	ResourceMemory Resource = "memory"
	// ResourceConnections: the database refuses more connections (53300).
	ResourceConnections Resource = "connections"
	// ResourceFileDescriptors: the process is at its limit of open files.
	ResourceFileDescriptors Resource = "file_descriptors"
)

// ExhaustedError is ErrExhausted with what ran short and why. Err, when
// set, is the driver's error, for logs.
type ExhaustedError struct {
	Resource Resource
	// Detail says what was refused and what is left, for logs (never
	// sent to callers).
	Detail string
	Err    error
}

func (e *ExhaustedError) Error() string {
	msg := ErrExhausted.Error() + ": " + string(e.Resource)
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns ErrExhausted and the cause.
func (e *ExhaustedError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrExhausted}
	}
	return []error{ErrExhausted, e.Err}
}

// Failing is implemented by stores that can fail for good within a
// process: the embedded store after Pebble's fatal commit error, whose
// write-ahead log is then in a state the process cannot trust. From then
// on every call answers ErrUnavailable (wrapping ErrFailed) without
// touching the store, and only a new process recovers it, from what was
// synced: everything acknowledged.
type Failing interface {
	// Failed is closed when the store has failed.
	Failed() <-chan struct{}
	// Failure is why, nil until Failed is closed.
	Failure() error
}

// ErrFailed is wrapped (with ErrUnavailable) in the answers of a store
// that failed for good (Failing).
var ErrFailed = errors.New("the store failed and needs a restart")

// Batcher is implemented by stores that decide many calls at once, in
// fewer round trips or writes than one per call. Each item is decided
// exactly as its single call would be (DecideClaim, DecideComplete); items
// on one key are decided in their order in the batch, each seeing the
// effect of the ones before it. One item's error is its answer alone,
// unless the store could not answer at all (ErrUnavailable for every item).
type Batcher interface {
	// ClaimBatch returns one answer per item of ps, in order.
	ClaimBatch(ctx context.Context, ps []ClaimParams) []ClaimAnswer
	// CompleteBatch returns one answer per item of ps, in order.
	CompleteBatch(ctx context.Context, ps []CompleteParams) []CompleteAnswer
}

// ClaimAnswer is one item's answer of Batcher.ClaimBatch: what Claim would
// have returned.
type ClaimAnswer struct {
	Result ClaimResult
	Err    error
}

// CompleteAnswer is one item's answer of Batcher.CompleteBatch: what
// Complete would have returned.
type CompleteAnswer struct {
	Record Record
	Err    error
}

// ClaimBatch decides ps on s: in one batch when s is a Batcher, else one
// Claim after the other, which answers the same.
func ClaimBatch(ctx context.Context, s Store, ps []ClaimParams) []ClaimAnswer {
	if b, ok := s.(Batcher); ok {
		return b.ClaimBatch(ctx, ps)
	}
	out := make([]ClaimAnswer, len(ps))
	for i, p := range ps {
		out[i].Result, out[i].Err = s.Claim(ctx, p)
	}
	return out
}

// CompleteBatch decides ps on s like ClaimBatch.
func CompleteBatch(ctx context.Context, s Store, ps []CompleteParams) []CompleteAnswer {
	if b, ok := s.(Batcher); ok {
		return b.CompleteBatch(ctx, ps)
	}
	out := make([]CompleteAnswer, len(ps))
	for i, p := range ps {
		out[i].Record, out[i].Err = s.Complete(ctx, p)
	}
	return out
}

// Op is one item of a mixed batch (Batch): a Claim, or a Complete.
// Exactly one of the two is set.
type Op struct {
	Claim    *ClaimParams
	Complete *CompleteParams
}

// OpAnswer is one item's answer of Batch: for a Claim, what Claim would
// have returned (Claim, Err); for a Complete, what Complete would have
// returned (Record, Err).
type OpAnswer struct {
	Claim  ClaimResult
	Record Record
	Err    error
}

// MixedBatcher is implemented by stores that decide Claims and Completes
// together: one transaction and one commit (one synced write) for all the
// items of a batch that fit, so that concurrent Claims and Completes share
// a round trip and a commit. Items are decided as Batcher's are: each as
// its single call would be, items on one key in their order (a key appears
// at most once in one transaction; a later item on it is decided after the
// earlier one's transaction), and one item's error is its answer alone.
type MixedBatcher interface {
	// Batch returns one answer per item of ops, in order.
	Batch(ctx context.Context, ops []Op) []OpAnswer
}

// Batch decides ops on s: in one batch when s is a MixedBatcher; else the
// Claims and the Completes each as a batch (Batcher) or one by one, in
// rounds that keep the order of items on one key.
func Batch(ctx context.Context, s Store, ops []Op) []OpAnswer {
	if b, ok := s.(MixedBatcher); ok {
		return b.Batch(ctx, ops)
	}
	out := make([]OpAnswer, len(ops))
	for _, round := range opRounds(ops) {
		var (
			ci, di []int
			cs     []ClaimParams
			ds     []CompleteParams
		)
		for _, i := range round {
			if p := ops[i].Claim; p != nil {
				ci, cs = append(ci, i), append(cs, *p)
			} else if p := ops[i].Complete; p != nil {
				di, ds = append(di, i), append(ds, *p)
			}
		}
		if len(ds) > 0 {
			for j, a := range CompleteBatch(ctx, s, ds) {
				out[di[j]] = OpAnswer{Record: a.Record, Err: a.Err}
			}
		}
		if len(cs) > 0 {
			for j, a := range ClaimBatch(ctx, s, cs) {
				out[ci[j]] = OpAnswer{Claim: a.Result, Err: a.Err}
			}
		}
	}
	return out
}

// Key returns the key the item names.
func (o Op) Key() Key {
	if o.Claim != nil {
		return o.Claim.Key
	}
	if o.Complete != nil {
		return o.Complete.Key
	}
	return Key{}
}

// opRounds splits ops into rounds in which each key appears once: round k
// holds the k-th item of each key, so that running the rounds in order
// keeps the order of the items on one key.
func opRounds(ops []Op) [][]int {
	var rounds [][]int
	seen := make(map[Key]int, len(ops))
	for i, o := range ops {
		k := o.Key()
		r := seen[k]
		seen[k] = r + 1
		if r == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[r] = append(rounds[r], i)
	}
	return rounds
}

// ClaimKeys is implemented by stores that keep the registry's claim keys:
// random bytes created on first use and then the same for every server
// that shares the store, across restarts. The server derives each claim's
// secret and seals its page tokens with them (server/secret.go), so that
// only the caller a Claim answered can complete, release or extend it.
// The keys never leave the server.
//
// Keys are versioned so that they can be rotated while servers run: a
// rotation adds a generation that becomes current at a time to come
// (every server has read it by then), and keeps the one it replaces
// accepted for a grace period after that, so that secrets and page tokens
// issued under it keep working on every server until they could no longer
// be in use.
type ClaimKeys interface {
	// ClaimKeyRing returns the generations still accepted, creating
	// generation 1 when the store has none. Concurrent first calls, also
	// from other processes, agree on one key. Errors: ErrUnavailable.
	ClaimKeyRing(ctx context.Context) (ClaimKeyRing, error)
	// RotateClaimKey adds a generation, one above the newest, that is
	// current from the store's clock plus p.ActivateAfter; the generation
	// it replaces is accepted until p.Grace after that. Generations whose
	// acceptance has ended are deleted. It returns the keys as they are
	// after the rotation. Errors: ErrUnavailable.
	RotateClaimKey(ctx context.Context, p RotateClaimKeyParams) (ClaimKeyRing, error)
}

// ClaimKey is one generation of the claim key. Times are the store's clock.
type ClaimKey struct {
	// Generation is 1 for the first key and one more for each rotation.
	Generation int64
	// Key is the key: ClaimKeySize random bytes.
	Key []byte
	// ActiveFrom is when servers start to issue secrets under it; until
	// then it is "next": accepted, never issued.
	ActiveFrom time.Time
	// AcceptUntil is when the key stops being accepted (a newer generation
	// replaced it); zero while it is the newest.
	AcceptUntil time.Time
}

// Accepted reports whether secrets under k are good at now (store's clock).
func (k ClaimKey) Accepted(now time.Time) bool {
	return k.AcceptUntil.IsZero() || now.Before(k.AcceptUntil)
}

// ClaimKeyRing is the claim keys a store keeps, as read at Now.
type ClaimKeyRing struct {
	// Keys are the generations still accepted at Now, newest first; never
	// empty.
	Keys []ClaimKey
	// Now is the store's clock when the keys were read.
	Now time.Time
}

// Current is the generation to issue secrets under at now: the newest
// whose ActiveFrom has come, else the oldest.
func (r ClaimKeyRing) Current(now time.Time) ClaimKey {
	for _, k := range r.Keys {
		if !now.Before(k.ActiveFrom) {
			return k
		}
	}
	return r.Keys[len(r.Keys)-1]
}

// RotateClaimKeyParams are the parameters of ClaimKeys.RotateClaimKey.
type RotateClaimKeyParams struct {
	// ActivateAfter is how long the new key is "next" before it becomes
	// current: at least the servers' refresh interval, so that every
	// server accepts it before any issues under it.
	ActivateAfter time.Duration
	// Grace is how long the replaced key stays accepted once the new one
	// is current: at least the longest a claim may be held (the
	// consumers' max_lease_total) and a page token be used.
	Grace time.Duration
}

// ClaimKeySize is the length of a claim key.
const ClaimKeySize = 32

// Sweeper is implemented by stores that can delete expired records in
// bounded batches; the retention package drives it.
type Sweeper interface {
	// SweepExpired deletes at most limit records whose ExpiresAt has passed
	// by the store's clock, oldest expiry first, in one short atomic unit.
	// The delete re-checks expiry, so a record extended or re-claimed
	// meanwhile is kept. It never deletes a live record.
	SweepExpired(ctx context.Context, limit int) (SweepResult, error)
	// OldestExpiry reports the earliest ExpiresAt among stored records,
	// expired or not, and the store's clock reading; ok is false when the
	// store holds no record.
	OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error)
}

// SweepResult is the answer of Sweeper.SweepExpired.
type SweepResult struct {
	// Deleted is how many records were deleted.
	Deleted int
	// Now is the store's clock reading used as the horizon.
	Now time.Time
}
