package storage

import (
	"context"
	"time"
)

// Admin is implemented by stores that let an operator inspect a record as
// stored and invalidate it. It is a separate capability because only the
// admin API uses it.
type Admin interface {
	// Inspect returns the record as stored, live or expired but not yet
	// swept, with its token and result, and the store's clock reading.
	// Errors: ErrNotFound (no stored record), ErrUnavailable.
	Inspect(ctx context.Context, k Key) (InspectResult, error)
	// Invalidate decides by DecideInvalidate and returns the stored record.
	// Errors: ErrNotFound, ErrLeaseLost (p.Token given and not current),
	// ErrUnavailable.
	Invalidate(ctx context.Context, p InvalidateParams) (Record, error)
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
	if cur.State == StateParked {
		rec.Attempt = 0
	}
	rec.State = StateInProgress
	rec.ParkReason = ""
	rec.Fingerprint = nil
	rec.Token = NextToken(cur.Token, now)
	rec.LeaseExpiresAt = now
	rec.CompletedAt = time.Time{}
	rec.Result = nil
	rec.ExpiresAt = maxTime(cur.ExpiresAt, now.Add(cur.Retention))
	return rec, true, nil
}
