package storage_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// The table tests below hold the state machine to docs/semantics.md row by
// row, without a store: what each Decide function answers, and the record
// it writes, for a given stored record at a given instant.

var (
	t0  = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	key = storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}
)

// stored is a record claimed at t0 with a 10 s lease and 1 h retention by
// holder "a" with fingerprint "fp" and request id "r1", changed by edit.
func stored(edit func(r *storage.Record)) *storage.Record {
	r := &storage.Record{
		Key: key, State: storage.StateInProgress, Fingerprint: []byte("fp"),
		Token: t0.UnixMicro(), Attempt: 1, Holder: "a", RequestID: "r1",
		CreatedAt: t0, LeaseExpiresAt: t0.Add(10 * time.Second), Lease: 10 * time.Second,
		ExpiresAt: t0.Add(10*time.Second + time.Hour), Retention: time.Hour,
	}
	if edit != nil {
		edit(r)
	}
	return r
}

// takenOver is the history entry of stored(nil)'s attempt ended by a
// takeover: its lease ended at t0+10s.
func takenOver(r *storage.Record) {
	r.History = []storage.Attempt{{Attempt: 1, Token: t0.UnixMicro(), Holder: "a", EndedAt: t0.Add(10 * time.Second), End: storage.AttemptTakenOver}}
}

// parkedAt parks a record at t0+20s (its lease ran out) with reason.
func parkedAt(reason string) func(r *storage.Record) {
	return func(r *storage.Record) {
		r.State, r.ParkReason, r.ExpiresAt = storage.StateParked, reason, t0.Add(20*time.Second+time.Hour)
	}
}

func completed(r *storage.Record) {
	r.State, r.Result, r.CompletedAt = storage.StateCompleted, []byte("result"), t0.Add(time.Second)
	r.ExpiresAt = t0.Add(time.Second + time.Hour)
}

// requireDecision checks what a Decide function returned: the error and no
// write when one is wanted, else the answer and whether it writes.
func requireDecision[T any](t *testing.T, want T, wantWrite bool, wantErr error, got T, write bool, err error) {
	t.Helper()
	if wantErr != nil {
		require.ErrorIs(t, err, wantErr)
		require.False(t, write, "an error writes nothing")
		return
	}
	require.NoError(t, err)
	require.Equal(t, wantWrite, write)
	require.Equal(t, want, got)
}

func TestDecideClaim(t *testing.T) {
	claim := func(fp, holder, requestID string) storage.ClaimParams {
		return storage.ClaimParams{Key: key, Fingerprint: []byte(fp), Lease: 20 * time.Second, Retention: 2 * time.Hour,
			Holder: holder, RequestID: requestID}
	}
	atMost := func(n int64, p storage.ClaimParams) storage.ClaimParams {
		p.MaxAttempts = n
		return p
	}
	fresh := func(now time.Time, prev int64, fp string) storage.Record {
		return storage.Record{
			Key: key, State: storage.StateInProgress, Fingerprint: []byte(fp),
			Token: max(prev+1, now.UnixMicro()), Attempt: 1, Holder: "b", RequestID: "r2",
			CreatedAt: now, LeaseExpiresAt: now.Add(20 * time.Second), Lease: 20 * time.Second,
			ExpiresAt: now.Add(20*time.Second + 2*time.Hour), Retention: 2 * time.Hour,
		}
	}
	for _, tc := range []struct {
		name      string
		now       time.Time
		cur       *storage.Record
		p         storage.ClaimParams
		want      storage.ClaimResult
		wantWrite bool
		wantErr   error
	}{
		{name: "absent: acquired, fresh record", now: t0, p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: fresh(t0, 0, "fp")}, wantWrite: true},
		{name: "expired in progress: a fresh record, tokens keep increasing",
			now: t0.Add(2 * time.Hour), cur: stored(func(r *storage.Record) { r.Token = t0.Add(3 * time.Hour).UnixMicro() }), p: claim("fp", "b", "r2"),
			want:      storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: fresh(t0.Add(2*time.Hour), t0.Add(3*time.Hour).UnixMicro(), "fp")},
			wantWrite: true},
		{name: "expired at the instant ExpiresAt is reached", now: t0.Add(time.Second + time.Hour), cur: stored(completed), p: claim("fp", "b", "r2"),
			want:      storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: fresh(t0.Add(time.Second+time.Hour), t0.UnixMicro(), "fp")},
			wantWrite: true},
		{name: "expired completed with another fingerprint: no conflict, fresh record",
			now: t0.Add(2 * time.Hour), cur: stored(completed), p: claim("other", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: fresh(t0.Add(2*time.Hour), t0.UnixMicro(), "other")}, wantWrite: true},
		{name: "completed: replay", now: t0.Add(time.Minute), cur: stored(completed), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeCompleted, Record: *stored(completed)}},
		{name: "completed, no fingerprint given: replay", now: t0.Add(time.Minute), cur: stored(completed), p: claim("", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeCompleted, Record: *stored(completed)}},
		{name: "completed, other fingerprint", now: t0.Add(time.Minute), cur: stored(completed), p: claim("other", "b", "r2"),
			wantErr: storage.ErrFingerprintMismatch},
		{name: "live lease: in progress with what is left of it", now: t0.Add(4 * time.Second), cur: stored(nil), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeInProgress, Record: *stored(nil), RetryAfter: 6 * time.Second}},
		{name: "live lease, other fingerprint", now: t0.Add(4 * time.Second), cur: stored(nil), p: claim("other", "b", "r2"),
			wantErr: storage.ErrFingerprintMismatch},
		{name: "live lease, same request id: a repeat, acquired without a write", now: t0.Add(4 * time.Second), cur: stored(nil), p: claim("fp", "a", "r1"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(nil), Repeated: true}},
		{name: "live lease, both request ids empty: in progress", now: t0.Add(4 * time.Second),
			cur: stored(func(r *storage.Record) { r.RequestID = "" }), p: claim("fp", "a", ""),
			want: storage.ClaimResult{Outcome: storage.OutcomeInProgress, Record: *stored(func(r *storage.Record) { r.RequestID = "" }), RetryAfter: 6 * time.Second}},
		{name: "lease over: takeover keeps the record, attempt + 1", now: t0.Add(10 * time.Second), cur: stored(nil), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(10 * time.Second)
				r.Token, r.Attempt, r.Holder, r.RequestID = now.UnixMicro(), 2, "b", "r2"
				takenOver(r)
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "lease over, same request id: a takeover, not a repeat", now: t0.Add(11 * time.Second), cur: stored(nil), p: claim("fp", "a", "r1"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(11 * time.Second)
				r.Token, r.Attempt = now.UnixMicro(), 2
				takenOver(r)
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "lease over, other fingerprint", now: t0.Add(11 * time.Second), cur: stored(nil), p: claim("other", "b", "r2"),
			wantErr: storage.ErrFingerprintMismatch},
		{name: "takeover of a record without fingerprint adopts the caller's", now: t0.Add(11 * time.Second),
			cur: stored(func(r *storage.Record) { r.Fingerprint = nil }), p: claim("new", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(11 * time.Second)
				r.Fingerprint, r.Token, r.Attempt, r.Holder, r.RequestID = []byte("new"), now.UnixMicro(), 2, "b", "r2"
				takenOver(r)
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "takeover with a token ahead of the clock: token + 1", now: t0.Add(11 * time.Second),
			cur: stored(func(r *storage.Record) { r.Token = t0.Add(time.Hour).UnixMicro() }), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(11 * time.Second)
				r.Token, r.Attempt, r.Holder, r.RequestID = t0.Add(time.Hour).UnixMicro()+1, 2, "b", "r2"
				r.History = []storage.Attempt{{Attempt: 1, Token: t0.Add(time.Hour).UnixMicro(), Holder: "a", EndedAt: t0.Add(10 * time.Second), End: storage.AttemptTakenOver}}
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "lease over below max attempts: takeover", now: t0.Add(20 * time.Second), cur: stored(nil), p: atMost(2, claim("fp", "b", "r2")),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(20 * time.Second)
				r.Token, r.Attempt, r.Holder, r.RequestID = now.UnixMicro(), 2, "b", "r2"
				takenOver(r)
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "lease over at max attempts exactly: parked as it is, kept for its retention from now",
			now: t0.Add(20 * time.Second), cur: stored(nil), p: atMost(1, claim("fp", "b", "r2")),
			want: storage.ClaimResult{Outcome: storage.OutcomeParked, Record: *stored(parkedAt(storage.ParkReasonMaxAttempts))}, wantWrite: true},
		{name: "lease over past max attempts (the bound was lowered): parked", now: t0.Add(20 * time.Second),
			cur: stored(func(r *storage.Record) { r.Attempt = 5 }), p: atMost(3, claim("", "b", "r2")),
			want: storage.ClaimResult{Outcome: storage.OutcomeParked, Record: *stored(func(r *storage.Record) {
				r.Attempt = 5
				parkedAt(storage.ParkReasonMaxAttempts)(r)
			})}, wantWrite: true},
		{name: "max attempts 0: unbounded", now: t0.Add(20 * time.Second), cur: stored(func(r *storage.Record) { r.Attempt = 100 }), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: *stored(func(r *storage.Record) {
				now := t0.Add(20 * time.Second)
				r.Token, r.Attempt, r.Holder, r.RequestID = now.UnixMicro(), 101, "b", "r2"
				r.History = []storage.Attempt{{Attempt: 100, Token: t0.UnixMicro(), Holder: "a", EndedAt: t0.Add(10 * time.Second), End: storage.AttemptTakenOver}}
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt, r.Retention = now.Add(20*time.Second), 20*time.Second, now.Add(20*time.Second+2*time.Hour), 2*time.Hour
			})}, wantWrite: true},
		{name: "live lease at max attempts: in progress, not parked", now: t0.Add(4 * time.Second), cur: stored(nil), p: atMost(1, claim("fp", "b", "r2")),
			want: storage.ClaimResult{Outcome: storage.OutcomeInProgress, Record: *stored(nil), RetryAfter: 6 * time.Second}},
		{name: "lease over at max attempts, other fingerprint: mismatch, not parked", now: t0.Add(20 * time.Second), cur: stored(nil),
			p: atMost(1, claim("other", "b", "r2")), wantErr: storage.ErrFingerprintMismatch},
		{name: "parked: parked, no write", now: t0.Add(time.Minute), cur: stored(parkedAt("why")), p: claim("fp", "b", "r2"),
			want: storage.ClaimResult{Outcome: storage.OutcomeParked, Record: *stored(parkedAt("why"))}},
		{name: "parked, same request id: parked", now: t0.Add(time.Minute), cur: stored(parkedAt("why")), p: claim("", "a", "r1"),
			want: storage.ClaimResult{Outcome: storage.OutcomeParked, Record: *stored(parkedAt("why"))}},
		{name: "parked, other fingerprint", now: t0.Add(time.Minute), cur: stored(parkedAt("why")), p: claim("other", "b", "r2"),
			wantErr: storage.ErrFingerprintMismatch},
		{name: "expired parked: a fresh record, tokens keep increasing", now: t0.Add(20*time.Second + time.Hour),
			cur: stored(parkedAt("why")), p: atMost(1, claim("fp", "b", "r2")),
			want: storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: func() storage.Record {
				r := fresh(t0.Add(20*time.Second+time.Hour), t0.UnixMicro(), "fp")
				return r
			}()}, wantWrite: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, write, err := storage.DecideClaim(tc.now, tc.cur, tc.p)
			requireDecision(t, tc.want, tc.wantWrite, tc.wantErr, res, write, err)
		})
	}
}

func TestDecideFenced(t *testing.T) {
	token := t0.UnixMicro()
	complete := func(r *storage.Record) { // completed at t0+5s with "new"
		r.State, r.Result, r.CompletedAt, r.ExpiresAt = storage.StateCompleted, []byte("new"), t0.Add(5*time.Second), t0.Add(5*time.Second+time.Hour)
	}
	type decide func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error)
	completeOp := func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error) {
		return storage.DecideComplete(now, cur, storage.CompleteParams{Key: key, Token: token, Result: []byte("new")})
	}
	releaseOp := func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error) {
		return storage.DecideRelease(now, cur, storage.ReleaseParams{Key: key, Token: token})
	}
	extendOp := func(lease time.Duration) decide {
		return func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error) {
			return storage.DecideExtend(now, cur, storage.ExtendParams{Key: key, Token: token, Lease: lease, DefaultLease: time.Minute})
		}
	}
	parkOp := func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error) {
		return storage.DecidePark(now, cur, storage.ParkParams{Key: key, Token: token, Reason: "unknown"})
	}
	extendTotal := func(lease, total time.Duration) decide {
		return func(now time.Time, cur *storage.Record, token int64) (storage.Record, bool, error) {
			return storage.DecideExtend(now, cur, storage.ExtendParams{Key: key, Token: token, Lease: lease, MaxLeaseTotal: total})
		}
	}
	for _, tc := range []struct {
		name      string
		op        decide
		now       time.Time
		cur       *storage.Record
		token     int64
		want      *storage.Record
		wantWrite bool
		wantErr   error
	}{
		{name: "complete: absent", op: completeOp, now: t0, token: token, wantErr: storage.ErrNotFound},
		{name: "complete: expired", op: completeOp, now: t0.Add(2 * time.Hour), cur: stored(nil), token: token, wantErr: storage.ErrNotFound},
		{name: "complete: stale token", op: completeOp, now: t0.Add(time.Second), cur: stored(nil), token: token - 1, wantErr: storage.ErrLeaseLost},
		{name: "complete: the holder", op: completeOp, now: t0.Add(5 * time.Second), cur: stored(nil), token: token,
			want: stored(complete), wantWrite: true},
		{name: "complete: after the lease ran out, nobody took over", op: completeOp, now: t0.Add(time.Minute), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.State, r.Result, r.CompletedAt, r.ExpiresAt = storage.StateCompleted, []byte("new"), t0.Add(time.Minute), t0.Add(time.Minute+time.Hour)
			}), wantWrite: true},
		{name: "complete: repeated, the first result stays", op: completeOp, now: t0.Add(time.Minute), cur: stored(completed), token: token,
			want: stored(completed)},
		{name: "release: the holder, the lease ends now", op: releaseOp, now: t0.Add(time.Second), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) { r.LeaseExpiresAt = t0.Add(time.Second) }), wantWrite: true},
		{name: "release: a lease that already ended, no write", op: releaseOp, now: t0.Add(time.Minute), cur: stored(nil), token: token,
			want: stored(nil)},
		{name: "release: completed", op: releaseOp, now: t0.Add(time.Minute), cur: stored(completed), token: token, wantErr: storage.ErrAlreadyCompleted},
		{name: "release: stale token", op: releaseOp, now: t0.Add(time.Second), cur: stored(nil), token: token + 1, wantErr: storage.ErrLeaseLost},
		{name: "extend: by the record's own lease", op: extendOp(0), now: t0.Add(5 * time.Second), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.ExpiresAt = t0.Add(15*time.Second), t0.Add(15*time.Second+time.Hour)
			}), wantWrite: true},
		{name: "extend: by the lease asked for, which the record keeps", op: extendOp(time.Minute), now: t0.Add(5 * time.Second), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(65*time.Second), time.Minute, t0.Add(65*time.Second+time.Hour)
			}), wantWrite: true},
		{name: "extend: a record without a lease takes the default", op: extendOp(0), now: t0.Add(5 * time.Second),
			cur: stored(func(r *storage.Record) { r.Lease = 0 }), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(65*time.Second), time.Minute, t0.Add(65*time.Second+time.Hour)
			}), wantWrite: true},
		{name: "extend: never shortens the retention", op: extendOp(time.Second), now: t0.Add(5 * time.Second),
			cur: stored(func(r *storage.Record) { r.ExpiresAt = t0.Add(5 * time.Hour) }), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(6*time.Second), time.Second, t0.Add(5*time.Hour)
			}), wantWrite: true},
		{name: "extend: completed", op: extendOp(0), now: t0.Add(time.Minute), cur: stored(completed), token: token, wantErr: storage.ErrAlreadyCompleted},
		{name: "extend: expired", op: extendOp(0), now: t0.Add(2 * time.Hour), cur: stored(nil), token: token, wantErr: storage.ErrNotFound},
		{name: "extend: within the lease total", op: extendTotal(time.Minute, 2*time.Minute), now: t0.Add(5 * time.Second), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(65*time.Second), time.Minute, t0.Add(65*time.Second+time.Hour)
			}), wantWrite: true},
		{name: "extend: to the end of the lease total exactly", op: extendTotal(time.Minute, 2*time.Minute), now: t0.Add(time.Minute), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(2*time.Minute), time.Minute, t0.Add(2*time.Minute+time.Hour)
			}), wantWrite: true},
		{name: "extend: past the lease total", op: extendTotal(time.Minute, 2*time.Minute), now: t0.Add(time.Minute + time.Microsecond), cur: stored(nil), token: token,
			wantErr: storage.ErrLeaseTotalExceeded},
		{name: "extend: past the lease total by the record's own lease", op: extendTotal(0, 20*time.Second), now: t0.Add(15 * time.Second), cur: stored(nil), token: token,
			wantErr: storage.ErrLeaseTotalExceeded},
		{name: "extend: the total counts from the token, the attempt's start", op: extendTotal(time.Minute, 2*time.Minute), now: t0.Add(2 * time.Minute),
			cur: stored(func(r *storage.Record) {
				r.Token = t0.Add(time.Minute).UnixMicro()
				r.LeaseExpiresAt = t0.Add(2*time.Minute + time.Second)
			}), token: t0.Add(time.Minute).UnixMicro(),
			want: stored(func(r *storage.Record) {
				r.Token = t0.Add(time.Minute).UnixMicro()
				r.LeaseExpiresAt, r.Lease, r.ExpiresAt = t0.Add(3*time.Minute), time.Minute, t0.Add(3*time.Minute+time.Hour)
			}), wantWrite: true},
		{name: "park: the holder, kept for its retention from now", op: parkOp, now: t0.Add(5 * time.Second), cur: stored(nil), token: token,
			want: stored(func(r *storage.Record) {
				r.State, r.ParkReason, r.ExpiresAt = storage.StateParked, "unknown", t0.Add(5*time.Second+time.Hour)
			}), wantWrite: true},
		{name: "park: after the lease ran out, nobody took over", op: parkOp, now: t0.Add(20 * time.Second), cur: stored(nil), token: token,
			want: stored(parkedAt("unknown")), wantWrite: true},
		{name: "park: repeated, the first reason stays", op: parkOp, now: t0.Add(time.Minute), cur: stored(parkedAt("first")), token: token,
			want: stored(parkedAt("first"))},
		{name: "park: stale token", op: parkOp, now: t0.Add(time.Second), cur: stored(nil), token: token - 1, wantErr: storage.ErrLeaseLost},
		{name: "park: parked, stale token", op: parkOp, now: t0.Add(time.Minute), cur: stored(parkedAt("first")), token: token - 1, wantErr: storage.ErrLeaseLost},
		{name: "park: completed", op: parkOp, now: t0.Add(time.Minute), cur: stored(completed), token: token, wantErr: storage.ErrAlreadyCompleted},
		{name: "park: absent", op: parkOp, now: t0, token: token, wantErr: storage.ErrNotFound},
		{name: "park: expired", op: parkOp, now: t0.Add(2 * time.Hour), cur: stored(nil), token: token, wantErr: storage.ErrNotFound},
		{name: "complete: parked", op: completeOp, now: t0.Add(time.Minute), cur: stored(parkedAt("why")), token: token, wantErr: storage.ErrParked},
		{name: "complete: parked, stale token", op: completeOp, now: t0.Add(time.Minute), cur: stored(parkedAt("why")), token: token + 1, wantErr: storage.ErrLeaseLost},
		{name: "release: parked", op: releaseOp, now: t0.Add(time.Minute), cur: stored(parkedAt("why")), token: token, wantErr: storage.ErrParked},
		{name: "extend: parked", op: extendOp(0), now: t0.Add(time.Minute), cur: stored(parkedAt("why")), token: token, wantErr: storage.ErrParked},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, write, err := tc.op(tc.now, tc.cur, tc.token)
			var want storage.Record
			if tc.want != nil {
				want = *tc.want
			}
			requireDecision(t, want, tc.wantWrite, tc.wantErr, rec, write, err)
		})
	}
}

func TestDecideInvalidateParked(t *testing.T) {
	now := t0.Add(time.Minute)
	cur := stored(func(r *storage.Record) {
		r.Attempt = 3
		parkedAt("why")(r)
	})
	rec, write, err := storage.DecideInvalidate(now, cur, storage.InvalidateParams{Key: key, Reason: "gone"})
	require.NoError(t, err)
	require.True(t, write)
	require.Equal(t, *stored(func(r *storage.Record) {
		r.Attempt, r.Fingerprint, r.Token, r.LeaseExpiresAt, r.Lease = 0, nil, now.UnixMicro(), now, 0
		r.ExpiresAt = now.Add(time.Hour)
		r.History = []storage.Attempt{{Attempt: 3, Token: t0.UnixMicro(), Holder: "a", EndedAt: now, End: storage.AttemptInvalidated, ParkReason: "why", Note: "gone"}}
	}), rec, "resolved: in progress, no reason, attempts counted afresh")
	res, _, err := storage.DecideClaim(now, &rec, storage.ClaimParams{Key: key, Lease: time.Second, Retention: time.Hour, MaxAttempts: 1})
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome, "the next Claim takes over")
	require.Equal(t, int64(1), res.Record.Attempt)
}

func TestDecideResolve(t *testing.T) {
	now := t0.Add(time.Minute)
	parked := stored(func(r *storage.Record) { r.Attempt = 3; parkedAt("unknown")(r) })
	resolve := func(token int64, complete bool) storage.ResolveParams {
		p := storage.ResolveParams{Key: key, Token: token, Reason: "checked the provider", Complete: complete}
		if complete {
			p.Result = []byte("by hand")
		}
		return p
	}
	entry := func(end storage.AttemptEnd, parkReason string, attempt int64) []storage.Attempt {
		return []storage.Attempt{{Attempt: attempt, Token: t0.UnixMicro(), Holder: "a", EndedAt: now, End: end, ParkReason: parkReason, Note: "checked the provider"}}
	}
	for _, tc := range []struct {
		name      string
		now       time.Time
		cur       *storage.Record
		p         storage.ResolveParams
		want      *storage.Record
		wantWrite bool
		wantErr   error
	}{
		{name: "absent", now: now, p: resolve(t0.UnixMicro(), true), wantErr: storage.ErrNotFound},
		{name: "expired", now: t0.Add(2 * time.Hour), cur: stored(nil), p: resolve(t0.UnixMicro(), true), wantErr: storage.ErrNotFound},
		{name: "another token: someone acted first", now: now, cur: parked, p: resolve(t0.UnixMicro()+1, true), wantErr: storage.ErrLeaseLost},
		{name: "completed: refused", now: now, cur: stored(completed), p: resolve(t0.UnixMicro(), false), wantErr: storage.ErrAlreadyCompleted},
		{name: "parked, with a result: completed under a fresh token, kept its retention from now", now: now, cur: parked, p: resolve(t0.UnixMicro(), true),
			want: stored(func(r *storage.Record) {
				r.Attempt, r.State, r.Result, r.CompletedAt, r.Token = 3, storage.StateCompleted, []byte("by hand"), now, now.UnixMicro()
				r.LeaseExpiresAt, r.ExpiresAt, r.Lease = t0.Add(10*time.Second), now.Add(time.Hour), 0
				r.History = entry(storage.AttemptResolvedCompleted, "unknown", 3)
			}), wantWrite: true},
		{name: "parked, released: in progress, lease over, attempt 0, fingerprint kept", now: now, cur: parked, p: resolve(t0.UnixMicro(), false),
			want: stored(func(r *storage.Record) {
				r.Attempt, r.Token, r.LeaseExpiresAt, r.ExpiresAt, r.Lease = 0, now.UnixMicro(), now, now.Add(time.Hour), 0
				r.History = entry(storage.AttemptResolvedReleased, "unknown", 3)
			}), wantWrite: true},
		{name: "stuck under a live lease, released: the lease ends now", now: t0.Add(5 * time.Second), cur: stored(nil), p: resolve(t0.UnixMicro(), false),
			want: stored(func(r *storage.Record) {
				at := t0.Add(5 * time.Second)
				r.Attempt, r.Token, r.LeaseExpiresAt, r.Lease = 0, at.UnixMicro(), at, 0
				r.History = []storage.Attempt{{Attempt: 1, Token: t0.UnixMicro(), Holder: "a", EndedAt: at, End: storage.AttemptResolvedReleased, Note: "checked the provider"}}
			}), wantWrite: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, write, err := storage.DecideResolve(tc.now, tc.cur, tc.p)
			var want storage.Record
			if tc.want != nil {
				want = *tc.want
			}
			requireDecision(t, want, tc.wantWrite, tc.wantErr, rec, write, err)
		})
	}
	// The resolved record answers the next Claim as the rules say.
	done, _, _ := storage.DecideResolve(now, parked, resolve(t0.UnixMicro(), true))
	res, write, err := storage.DecideClaim(now.Add(time.Second), &done, storage.ClaimParams{Key: key, Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.False(t, write)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome, "the operator's result is replayed")
	again, _, _ := storage.DecideResolve(now, parked, resolve(t0.UnixMicro(), false))
	res, _, err = storage.DecideClaim(now.Add(time.Second), &again, storage.ClaimParams{Key: key, Fingerprint: []byte("fp"), Lease: time.Second, Retention: time.Hour, MaxAttempts: 3})
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome, "released: the next Claim acquires")
	require.Equal(t, int64(1), res.Record.Attempt, "attempts counted afresh")
	require.Greater(t, res.Record.Token, again.Token)
	require.Empty(t, res.Record.History[1:], "the operator's token, held by nobody, adds no attempt when taken over")
}

func TestHistoryIsBounded(t *testing.T) {
	cur := stored(nil)
	now := t0
	for i := range storage.MaxHistory + 3 {
		now = now.Add(time.Minute)
		res, write, err := storage.DecideClaim(now, cur, storage.ClaimParams{Key: key, Fingerprint: []byte("fp"), Holder: fmt.Sprint("h", i),
			Lease: time.Second, Retention: time.Hour})
		require.NoError(t, err)
		require.True(t, write)
		prev := cur
		cur = &res.Record
		require.LessOrEqual(t, len(cur.History), storage.MaxHistory)
		last := cur.History[len(cur.History)-1]
		require.Equal(t, prev.Token, last.Token, "the attempt taken over is the last entry")
		require.Equal(t, prev.Attempt, last.Attempt)
		require.True(t, last.EndedAt.Equal(prev.LeaseExpiresAt))
		require.Len(t, prev.History, min(i, storage.MaxHistory), "a decision does not change the record it was given")
	}
	require.Len(t, cur.History, storage.MaxHistory)
	require.Equal(t, int64(storage.MaxHistory+4)-int64(storage.MaxHistory), cur.History[0].Attempt, "the oldest entries go first")
}

func TestDecideLookup(t *testing.T) {
	_, err := storage.DecideLookup(t0, nil)
	require.ErrorIs(t, err, storage.ErrNotFound)
	_, err = storage.DecideLookup(t0.Add(2*time.Hour), stored(nil))
	require.ErrorIs(t, err, storage.ErrNotFound, "expired but not swept")
	rec, err := storage.DecideLookup(t0.Add(time.Minute), stored(nil))
	require.NoError(t, err)
	require.Equal(t, *stored(nil), rec)
}

func TestNextTokenAndFingerprints(t *testing.T) {
	require.Equal(t, t0.UnixMicro(), storage.NextToken(0, t0), "the clock in µs")
	require.Equal(t, t0.UnixMicro()+1, storage.NextToken(t0.UnixMicro(), t0), "above the previous token")
	require.Equal(t, int64(1<<60)+1, storage.NextToken(1<<60, t0), "a token ahead of the clock")
	for _, tc := range []struct {
		stored, given string
		conflict      bool
	}{{"", "", false}, {"a", "", false}, {"", "a", false}, {"a", "a", false}, {"a", "b", true}} {
		require.Equal(t, tc.conflict, storage.FingerprintsConflict([]byte(tc.stored), []byte(tc.given)), "%q vs %q", tc.stored, tc.given)
	}
}
