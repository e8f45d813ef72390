package storage

import (
	"context"
	"time"
)

// Admin is implemented by stores that let an operator inspect, list,
// resolve and invalidate records. It is a separate capability because only
// the admin API uses it.
type Admin interface {
	// Inspect returns the record as stored, live or expired but not yet
	// swept, with its token and result, and the store's clock reading.
	// Errors: ErrNotFound (no stored record), ErrUnavailable.
	Inspect(ctx context.Context, k Key) (InspectResult, error)
	// Invalidate decides by DecideInvalidate and returns the stored record.
	// Errors: ErrNotFound, ErrLeaseLost (p.Token given and not current),
	// ErrUnavailable.
	Invalidate(ctx context.Context, p InvalidateParams) (Record, error)
	// Resolve decides by DecideResolve and returns the stored record.
	// Errors: ErrNotFound, ErrLeaseLost, ErrAlreadyCompleted,
	// ErrUnavailable.
	Resolve(ctx context.Context, p ResolveParams) (Record, error)
	// List returns one page of the live records that match p, in key order
	// (consumer, kind, key), with their History and without their Result.
	// It reads at most ListScanLimit(p.Limit) entries of an index (the
	// primary key, or an index of parked records when p.State is
	// StateParked), so a page may be short, even empty, while Next is set.
	// Errors: ErrUnavailable.
	List(ctx context.Context, p ListParams) (ListResult, error)
	// CountParked counts the live parked records of the consumers whose
	// name starts with prefix, from an index of parked records (never a
	// scan of all records). Consumers with none are absent from the map.
	// Errors: ErrUnavailable.
	CountParked(ctx context.Context, prefix string) (map[string]int64, error)
}

// MaxHistory bounds Record.History.
const MaxHistory = 5

// AttemptEnd says how an attempt in Record.History ended.
type AttemptEnd uint8

const (
	// AttemptTakenOver: its lease ended (ran out, or was released) and a
	// Claim took over; EndedAt is when its lease ended.
	AttemptTakenOver AttemptEnd = 1
	// AttemptInvalidated: an operator invalidated the record.
	AttemptInvalidated AttemptEnd = 2
	// AttemptResolvedCompleted: an operator resolved it with a result.
	AttemptResolvedCompleted AttemptEnd = 3
	// AttemptResolvedReleased: an operator released it for a fresh attempt.
	AttemptResolvedReleased AttemptEnd = 4
)

// Attempt is an ended acquisition of a record.
type Attempt struct {
	Attempt int64
	Token   int64
	Holder  string
	// EndedAt is when its lease ended (AttemptTakenOver) or the store's
	// clock when the operator acted.
	EndedAt time.Time
	End     AttemptEnd
	// ParkReason is the record's ParkReason when the attempt ended.
	ParkReason string
	// Note is the operator's reason, for an operator's end.
	Note string
}

// AcquiredAt is when the attempt started, read off its token.
func (a Attempt) AcquiredAt() time.Time { return AcquiredAt(a.Token) }

// appendHistory is h with a appended, keeping the last MaxHistory entries.
// It never shares h's backing array, so a Decide function does not change
// the record it was given.
func appendHistory(h []Attempt, a Attempt) []Attempt {
	if len(h) >= MaxHistory {
		h = h[len(h)-MaxHistory+1:]
	}
	out := make([]Attempt, 0, len(h)+1)
	return append(append(out, h...), a)
}

// ended is cur's current attempt ended at at, by end, with note.
func ended(cur *Record, at time.Time, end AttemptEnd, note string) Attempt {
	return Attempt{Attempt: cur.Attempt, Token: cur.Token, Holder: cur.Holder, EndedAt: at, End: end,
		ParkReason: cur.ParkReason, Note: note}
}

// ListParams are the arguments of Admin.List.
type ListParams struct {
	// Consumer is the consumer to list, or with Prefix the start of the
	// names of the consumers to list ("" with Prefix: every consumer).
	Consumer string
	Prefix   bool
	// State, when not zero, lists only records in that state.
	State State
	// MinAttempt, when positive, lists only records with Attempt >= it.
	MinAttempt int64
	// OlderThan, when positive, lists only records created at least that
	// long before the store's clock.
	OlderThan time.Duration
	// After, when not nil, starts the page after this key (exclusive): the
	// Next of the previous page.
	After *Key
	// Limit is the most records a page holds; positive.
	Limit int
}

// Matches reports whether the live record r matches p's filters at now
// (not the key range: Consumer, Prefix and After).
func (p ListParams) Matches(now time.Time, r *Record) bool {
	return r.Live(now) &&
		(p.State == 0 || r.State == p.State) &&
		(p.MinAttempt <= 0 || r.Attempt >= p.MinAttempt) &&
		(p.OlderThan <= 0 || !r.CreatedAt.After(now.Add(-p.OlderThan)))
}

// ListScanLimit is the most index entries one page of List reads for a
// page of limit records: enough that a sparse filter still fills pages,
// few enough that a page costs a bounded read.
func ListScanLimit(limit int) int { return max(10*limit, 1000) }

// ListResult is the answer of Admin.List.
type ListResult struct {
	Records []Record
	// Next is where the next page starts (ListParams.After); nil when the
	// listing is over.
	Next *Key
	// Now is the store's clock reading the page was decided at.
	Now time.Time
}

// ResolveParams are the arguments of Admin.Resolve.
type ResolveParams struct {
	Key
	// Token must be the record's current token: the one the operator
	// inspected, so that of two operators only the first acts.
	Token int64
	// Complete resolves the record with Result; else it is released for a
	// fresh attempt.
	Complete bool
	Result   []byte
	// Reason is the operator's reason, kept in the history; not empty.
	Reason string
}

// DecideResolve decides an operator's resolution of a parked or in-progress
// record (its lease live or not), or the repair of a completed one's result. Either way the record gets a token larger
// than any before and nobody holds, which fences out its holder, and the
// attempt it ends is appended to History with the operator's reason:
//
//   - Complete: the record becomes completed with Result, kept for its
//     retention from now, and every later Claim replays it;
//   - release: it becomes in progress with its lease ended now and its
//     Attempt at 0, so the next Claim acquires it as attempt 1 and the
//     consumer's max_attempts counts afresh. The fingerprint stays (unlike
//     Invalidate, this is the same operation tried again).
//
// A completed record may only be resolved with a result, which replaces
// the stored one (a repair: a result that cannot be replayed, such as
// bytes that do not decode as their type, replaced in one step, so that no
// Claim in between finds the key free and does the work again); its
// release is refused with ErrAlreadyCompleted, since Invalidate is the
// tool to drop a result.
func DecideResolve(now time.Time, cur *Record, p ResolveParams) (rec Record, write bool, err error) {
	if !cur.Live(now) {
		return Record{}, false, ErrNotFound
	}
	if cur.Token != p.Token {
		return Record{}, false, ErrLeaseLost
	}
	if cur.State == StateCompleted && !p.Complete {
		return Record{}, false, ErrAlreadyCompleted
	}
	rec = *cur
	rec.Token = NextToken(cur.Token, now)
	rec.Lease = 0 // nobody holds the new token
	rec.ParkReason = ""
	rec.LeaseExpiresAt = minTime(cur.LeaseExpiresAt, now)
	if p.Complete {
		rec.History = appendHistory(cur.History, ended(cur, now, AttemptResolvedCompleted, p.Reason))
		rec.State = StateCompleted
		rec.Result = p.Result
		rec.CompletedAt = now
		rec.ExpiresAt = now.Add(cur.Retention)
		return rec, true, nil
	}
	rec.History = appendHistory(cur.History, ended(cur, now, AttemptResolvedReleased, p.Reason))
	rec.State = StateInProgress
	rec.Attempt = 0
	rec.LeaseExpiresAt = now
	rec.ExpiresAt = maxTime(cur.ExpiresAt, now.Add(cur.Retention))
	return rec, true, nil
}

// InspectResult is the answer of Admin.Inspect.
type InspectResult struct {
	Record Record
	// Now is the store's clock when the record was read: the record is live
	// when Now is before Record.ExpiresAt.
	Now time.Time
}

// InvalidateParams are the arguments of Admin.Invalidate.
type InvalidateParams struct {
	Key
	// Token, when not zero, must be the record's current token, so that an
	// operator invalidates the record they inspected and not a newer one.
	Token int64
	// Reason is the operator's reason, kept in the history.
	Reason string
}

// DecideInvalidate decides an invalidation: the record is kept, but as an
// in-progress record whose lease ended now, under a fresh token nobody
// holds, without its result and fingerprint. So:
//
//   - the next Claim of the key acquires at once, with any fingerprint, as a
//     takeover (attempt + 1, which tells the new holder an earlier attempt
//     may have had effects) and a token larger than any issued before;
//   - every earlier holder's Complete, Release and Extend fail with
//     ErrLeaseLost, so a stuck holder that wakes up cannot write;
//   - a parked record is resolved: it is no longer parked, and its Attempt
//     starts again from 0, so that the consumer's max_attempts counts
//     afresh and the next Claim takes over (as attempt 1) instead of
//     parking it again.
//
// The record is not deleted because its row carries the token floor of the
// key: after a delete, NextToken would rely on the clock alone, which has not
// moved past the last token if that token was issued an instant before (or
// if a CockroachDB node's clock lags another's). Keeping the record until at
// least its retention after the new token keeps the usual argument of
// NextToken true: when it is finally swept, the clock is far past its token.
func DecideInvalidate(now time.Time, cur *Record, p InvalidateParams) (rec Record, write bool, err error) {
	if !cur.Live(now) {
		return Record{}, false, ErrNotFound
	}
	if p.Token != 0 && cur.Token != p.Token {
		return Record{}, false, ErrLeaseLost
	}
	rec = *cur
	rec.History = appendHistory(cur.History, ended(cur, now, AttemptInvalidated, p.Reason))
	if cur.State == StateParked {
		rec.Attempt = 0
	}
	rec.State = StateInProgress
	rec.ParkReason = ""
	rec.Fingerprint = nil
	rec.Token = NextToken(cur.Token, now)
	rec.Lease = 0 // nobody holds the new token: its takeover adds no history
	rec.LeaseExpiresAt = now
	rec.CompletedAt = time.Time{}
	rec.Result = nil
	rec.ExpiresAt = maxTime(cur.ExpiresAt, now.Add(cur.Retention))
	return rec, true, nil
}
