package storage

import (
	"bytes"
	"time"
)

// This file is the registry's state machine. Each Decide function takes the
// store's clock reading, the stored record (nil when absent) and the request,
// and returns what the store must answer and, when write is true, the record
// it must store in place of cur. The embedded store executes these functions
// under its per-key serialisation; the SQL store expresses the same
// predicates in its conditional statements and runs these functions on the
// record it read to classify every answer it did not write. The conformance
// suite (storage/storagetest) holds both to the same table.

// Live reports whether r counts as present at now: a record whose ExpiresAt
// has passed is absent, whether or not it was swept yet.
func (r *Record) Live(now time.Time) bool { return r != nil && now.Before(r.ExpiresAt) }

// LeaseLive reports whether r's lease is still running at now.
func (r *Record) LeaseLive(now time.Time) bool { return now.Before(r.LeaseExpiresAt) }

// FingerprintsConflict reports whether a stored and a given fingerprint
// disagree. An empty fingerprint on either side matches anything.
func FingerprintsConflict(stored, given []byte) bool {
	return len(stored) > 0 && len(given) > 0 && !bytes.Equal(stored, given)
}

// NextToken is the token issued after prev at now: greater than prev, and
// never below the clock in microseconds. Taking the clock into account keeps
// tokens increasing after a record expired and was deleted: a deleted record
// expired at least its retention after its last token was issued, so the
// clock has moved past every token it ever held, unless the clock stepped
// back by more than that retention (the minimum retention bounds it).
func NextToken(prev int64, now time.Time) int64 {
	return max(prev+1, now.UnixMicro())
}

// DecideClaim decides a Claim. On acquisition it returns the new record with
// write set. Otherwise cur is unchanged and the result describes it; a
// repeat of the Claim that holds a live lease (same non-empty RequestID) is
// answered OUTCOME_ACQUIRED with cur as it is, without a write.
//
// A takeover of a record whose Attempt has reached a positive MaxAttempts
// parks the record instead (parkOnClaim): OutcomeParked with the parked
// record, written. A live parked record answers OutcomeParked without a
// write until it expires or an operator invalidates it.
func DecideClaim(now time.Time, cur *Record, p ClaimParams) (res ClaimResult, write bool, err error) {
	if !cur.Live(now) {
		var prev int64
		if cur != nil {
			prev = cur.Token
		}
		rec := Record{
			Key:            p.Key,
			State:          StateInProgress,
			Fingerprint:    p.Fingerprint,
			Token:          NextToken(prev, now),
			Attempt:        1,
			Holder:         p.Holder,
			RequestID:      p.RequestID,
			CreatedAt:      now,
			LeaseExpiresAt: now.Add(p.Lease),
			Lease:          p.Lease,
			ExpiresAt:      now.Add(p.Lease + p.Retention),
			Retention:      p.Retention,
		}
		return ClaimResult{Outcome: OutcomeAcquired, Record: rec}, true, nil
	}
	if FingerprintsConflict(cur.Fingerprint, p.Fingerprint) {
		return ClaimResult{}, false, ErrFingerprintMismatch
	}
	switch {
	case cur.State == StateCompleted:
		return ClaimResult{Outcome: OutcomeCompleted, Record: *cur}, false, nil
	case cur.State == StateParked:
		return ClaimResult{Outcome: OutcomeParked, Record: *cur}, false, nil
	case cur.LeaseLive(now) && p.RequestID != "" && p.RequestID == cur.RequestID:
		// A repeat of the Claim that holds the lease (its reply was lost):
		// the same answer again, nothing written.
		return ClaimResult{Outcome: OutcomeAcquired, Record: *cur, Repeated: true}, false, nil
	case cur.LeaseLive(now):
		return ClaimResult{Outcome: OutcomeInProgress, Record: *cur, RetryAfter: cur.LeaseExpiresAt.Sub(now)}, false, nil
	}
	if AttemptsExhausted(cur, p.MaxAttempts) {
		return ClaimResult{Outcome: OutcomeParked, Record: park(now, cur, ParkReasonMaxAttempts)}, true, nil
	}
	// Takeover of an expired lease.
	rec := *cur
	if cur.Lease > 0 {
		// Someone held the token taken over (not an operator's fresh one).
		rec.History = appendHistory(cur.History, ended(cur, cur.LeaseExpiresAt, AttemptTakenOver, ""))
	}
	if len(rec.Fingerprint) == 0 {
		rec.Fingerprint = p.Fingerprint
	}
	rec.Token = NextToken(cur.Token, now)
	rec.Attempt = cur.Attempt + 1
	rec.Holder = p.Holder
	rec.RequestID = p.RequestID
	rec.LeaseExpiresAt = now.Add(p.Lease)
	rec.Lease = p.Lease
	rec.ExpiresAt = now.Add(p.Lease + p.Retention)
	rec.Retention = p.Retention
	return ClaimResult{Outcome: OutcomeAcquired, Record: rec}, true, nil
}

// AttemptsExhausted reports whether a takeover of cur would exceed
// maxAttempts (positive): cur was acquired that many times already.
func AttemptsExhausted(cur *Record, maxAttempts int64) bool {
	return maxAttempts > 0 && cur.Attempt >= maxAttempts
}

// park is cur parked at now with reason. The token, attempt, holder,
// fingerprint and lease stay as they were (the token floor of the key is
// the record's token, as for any record); the record is kept for its
// retention from now, like a completion, and then swept like any expired
// record, after which the key starts afresh with a larger token.
func park(now time.Time, cur *Record, reason string) Record {
	rec := *cur
	rec.State = StateParked
	rec.ParkReason = reason
	rec.ExpiresAt = now.Add(cur.Retention)
	return rec
}

// fenced checks the token of a Complete, Release or Extend.
func fenced(now time.Time, cur *Record, token int64) error {
	if !cur.Live(now) {
		return ErrNotFound
	}
	if cur.Token != token {
		return ErrLeaseLost
	}
	return nil
}

// DecideComplete decides a Complete. The current token may complete even
// after its lease ran out, as long as nobody took over. Completing an
// already completed record with its token is a success without a write, so
// a caller whose reply was lost can retry; the first result stays.
func DecideComplete(now time.Time, cur *Record, p CompleteParams) (rec Record, write bool, err error) {
	if err := fenced(now, cur, p.Token); err != nil {
		return Record{}, false, err
	}
	if cur.State == StateParked {
		return Record{}, false, ErrParked
	}
	if cur.State == StateCompleted {
		return *cur, false, nil
	}
	rec = *cur
	rec.State = StateCompleted
	rec.Result = p.Result
	rec.CompletedAt = now
	rec.ExpiresAt = now.Add(cur.Retention)
	return rec, true, nil
}

// DecideRelease decides a Release: the lease ends now so the next Claim
// acquires at once. Releasing a lease that already ended is a success
// without a write.
func DecideRelease(now time.Time, cur *Record, p ReleaseParams) (rec Record, write bool, err error) {
	if err := fenced(now, cur, p.Token); err != nil {
		return Record{}, false, err
	}
	if err := notFinal(cur); err != nil {
		return Record{}, false, err
	}
	if !cur.LeaseLive(now) {
		return *cur, false, nil
	}
	rec = *cur
	rec.LeaseExpiresAt = now
	return rec, true, nil
}

// DecideExtend decides an Extend: the lease runs for ExtendLease from now, and
// the record is kept at least its retention after the new lease ends. A
// lease that would end after LeaseNotAfter is refused, not shortened: the
// holder learns that its time is up while it still holds the lease it had.
func DecideExtend(now time.Time, cur *Record, p ExtendParams) (rec Record, write bool, err error) {
	if err := fenced(now, cur, p.Token); err != nil {
		return Record{}, false, err
	}
	if err := notFinal(cur); err != nil {
		return Record{}, false, err
	}
	lease := ExtendLease(cur, p)
	if p.MaxLeaseTotal > 0 && now.Add(lease).After(LeaseNotAfter(cur, p.MaxLeaseTotal)) {
		return Record{}, false, ErrLeaseTotalExceeded
	}
	rec = *cur
	rec.LeaseExpiresAt = now.Add(lease)
	rec.Lease = lease
	rec.ExpiresAt = maxTime(cur.ExpiresAt, rec.LeaseExpiresAt.Add(cur.Retention))
	return rec, true, nil
}

// notFinal refuses a Release or Extend of a completed or parked record.
func notFinal(cur *Record) error {
	switch cur.State {
	case StateCompleted:
		return ErrAlreadyCompleted
	case StateParked:
		return ErrParked
	}
	return nil
}

// DecidePark decides a Park: the holder of the current token parks the
// record with its reason, because the outcome of its work is unknown and
// the key must not be done again (see park). Parking a parked record with
// its token is a success without a write, so a caller whose reply was lost
// can retry; the first reason stays. A completed record is refused.
func DecidePark(now time.Time, cur *Record, p ParkParams) (rec Record, write bool, err error) {
	if err := fenced(now, cur, p.Token); err != nil {
		return Record{}, false, err
	}
	switch cur.State {
	case StateCompleted:
		return Record{}, false, ErrAlreadyCompleted
	case StateParked:
		return *cur, false, nil
	}
	return park(now, cur, p.Reason), true, nil
}

// ExtendLease is the lease an Extend grants: the one it asks for, else the
// record's own, else the default (a record written before records kept
// their lease).
func ExtendLease(cur *Record, p ExtendParams) time.Duration {
	switch {
	case p.Lease > 0:
		return p.Lease
	case cur.Lease > 0:
		return cur.Lease
	}
	return p.DefaultLease
}

// AcquiredAt is when the attempt holding token started, read off the token
// itself: NextToken issues a token no smaller than the store's clock in
// microseconds, and only an acquisition issues one. It is never earlier
// than the acquisition, later only when the key's tokens ran ahead of the
// clock (acquisitions within one microsecond, a clock that stepped back),
// which can only lengthen what LeaseNotAfter allows, never shorten it.
func AcquiredAt(token int64) time.Time { return time.UnixMicro(token) }

// LeaseNotAfter is the latest end of a lease that an Extend of cur may
// grant when one attempt may hold the key for maxTotal: counted from the
// start of the attempt, so a takeover starts afresh and Extend alone
// cannot hold a key forever.
func LeaseNotAfter(cur *Record, maxTotal time.Duration) time.Time {
	return AcquiredAt(cur.Token).Add(maxTotal)
}

// DecideLookup decides a Lookup.
func DecideLookup(now time.Time, cur *Record) (Record, error) {
	if !cur.Live(now) {
		return Record{}, ErrNotFound
	}
	return *cur, nil
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
