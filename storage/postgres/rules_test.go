package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// TestExtendRecordWithoutLease: a row written before records kept their
// lease (lease_us 0, as migration 0004 leaves old rows) is extended by the
// default lease when the Extend asks for none.
func TestExtendRecordWithoutLease(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL)
	k := storage.Key{Consumer: "legacy", Kind: storage.KindOperation, Key: "k"}
	res, err := s.Claim(t.Context(), storage.ClaimParams{Key: k, Lease: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), `UPDATE idemreg_records SET lease_us = 0 WHERE consumer = 'legacy'`)
	require.NoError(t, err)

	rec, err := s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: res.Record.Token, DefaultLease: 2 * time.Minute})
	require.NoError(t, err)
	require.Equal(t, 2*time.Minute, rec.Lease)
	left := time.Until(rec.LeaseExpiresAt)
	require.Greater(t, left, time.Minute, "the default, not zero")
	require.Less(t, left, 30*time.Minute, "the default, not the hour it was claimed with")
}

// TestWrittenRowsAgreeWithTheRules runs every kind of write the statements
// make, one at a time, and checks that the row each wrote is exactly the
// record the storage.Decide* function makes from the row before it (read
// with Inspect; nothing else runs, so it is the row the write saw) at the
// statement's own clock reading; the history, which no statement but
// Inspect and List returns, is read back with Inspect. Declined writes are
// checked on every call
// (Store.decided); this checks the written ones, which the store does not
// check at run time: at READ COMMITTED its pre-image may be older than the
// row the write changed.
func TestWrittenRowsAgreeWithTheRules(t *testing.T) {
	var clock storagetest.Clock
	s := openStore(t, pgtest.NewDatabase(t), postgres.WithClockOffset(clock.Offset))
	ctx := t.Context()
	k := storage.Key{Consumer: "rules", Kind: storage.KindOperation, Key: "k"}
	normal := func(r storage.Record) storage.Record {
		if len(r.Fingerprint) == 0 {
			r.Fingerprint = nil
		}
		if len(r.Result) == 0 {
			r.Result = nil
		}
		return r
	}
	type decision func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error)
	type step struct {
		name    string
		advance time.Duration // of the clock before the step
		p       func() any
		decide  decision
	}
	var (
		token int64
		steps []step
	)
	add := func(name string, advance time.Duration, p func() any, decide decision) {
		steps = append(steps, step{name, advance, p, decide})
	}
	claim := func(fp, holder string, lease time.Duration) func() any {
		return func() any {
			return storage.ClaimParams{Key: k, Fingerprint: []byte(fp), Lease: lease, Retention: time.Hour, Holder: holder, RequestID: holder + "-req"}
		}
	}
	decideClaim := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		res, write, err := storage.DecideClaim(now, pre, p.(storage.ClaimParams))
		return res.Record, write, err
	}
	decideComplete := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecideComplete(now, pre, p.(storage.CompleteParams))
	}
	decideRelease := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecideRelease(now, pre, p.(storage.ReleaseParams))
	}
	decideExtend := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecideExtend(now, pre, p.(storage.ExtendParams))
	}
	decideInvalidate := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecideInvalidate(now, pre, p.(storage.InvalidateParams))
	}
	decidePark := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecidePark(now, pre, p.(storage.ParkParams))
	}
	decideResolve := func(now time.Time, pre *storage.Record, p any) (storage.Record, bool, error) {
		return storage.DecideResolve(now, pre, p.(storage.ResolveParams))
	}
	claimAtMost := func(maxAttempts int64, holder string) func() any {
		return func() any {
			p := claim("new", holder, 10*time.Second)().(storage.ClaimParams)
			p.MaxAttempts = maxAttempts
			return p
		}
	}
	add("claim of a new key", 0, claim("fp", "a", 10*time.Second), decideClaim)
	add("extend by a new lease", time.Second, func() any {
		return storage.ExtendParams{Key: k, Token: token, Lease: 20 * time.Second, DefaultLease: time.Minute}
	}, decideExtend)
	add("extend by the record's lease", time.Second, func() any { return storage.ExtendParams{Key: k, Token: token, DefaultLease: time.Minute} }, decideExtend)
	add("extend within a lease total", time.Second, func() any {
		return storage.ExtendParams{Key: k, Token: token, Lease: 20 * time.Second, MaxLeaseTotal: time.Minute}
	}, decideExtend)
	add("release", time.Second, func() any { return storage.ReleaseParams{Key: k, Token: token} }, decideRelease)
	add("takeover after the release", time.Second, claim("fp", "b", 30*time.Second), decideClaim)
	add("takeover after the lease ran out", time.Minute, claim("", "c", 30*time.Second), decideClaim)
	add("complete", time.Second, func() any { return storage.CompleteParams{Key: k, Token: token, Result: []byte("result")} }, decideComplete)
	add("claim of the expired completed record", 2*time.Hour, claim("other", "d", 10*time.Second), decideClaim)
	add("invalidate", time.Second, func() any { return storage.InvalidateParams{Key: k, Token: token} }, decideInvalidate)
	add("takeover of the invalidated record adopts the fingerprint", time.Second, claim("new", "e", 10*time.Second), decideClaim)
	add("park by the holder", time.Second, func() any { return storage.ParkParams{Key: k, Token: token, Reason: "outcome unknown"} }, decidePark)
	add("invalidate the parked record", time.Second, func() any { return storage.InvalidateParams{Key: k, Token: token} }, decideInvalidate)
	add("takeover of the resolved record, attempts counted afresh", time.Second, claimAtMost(2, "f"), decideClaim)
	add("takeover within max attempts", 11*time.Second, claimAtMost(2, "g"), decideClaim)
	add("takeover at max attempts parks", 11*time.Second, claimAtMost(2, "h"), decideClaim)
	add("claim of the expired parked record", 2*time.Hour, claimAtMost(2, "i"), decideClaim)
	add("park for the operator", time.Second, func() any { return storage.ParkParams{Key: k, Token: token, Reason: "unknown"} }, decidePark)
	add("release the parked record", time.Second, func() any {
		return storage.ResolveParams{Key: k, Token: token, Reason: "retry it"}
	}, decideResolve)
	add("takeover of the released record adds no history", time.Second, claim("new", "j", 10*time.Second), decideClaim)
	add("resolve the record under a live lease with a result", time.Second, func() any {
		return storage.ResolveParams{Key: k, Token: token, Complete: true, Result: []byte("by hand"), Reason: "done by hand"}
	}, decideResolve)
	add("invalidate the resolved record", time.Second, func() any { return storage.InvalidateParams{Key: k, Token: token, Reason: "wrong"} }, decideInvalidate)
	add("takeover of the invalidated record", time.Second, claim("new", "k", 10*time.Second), decideClaim)
	for i := range storage.MaxHistory + 1 {
		add(fmt.Sprint("takeover ", i, " keeps the history bounded"), 11*time.Second, claim("new", fmt.Sprint("l", i), 10*time.Second), decideClaim)
	}

	for _, st := range steps {
		clock.Advance(st.advance)
		var pre *storage.Record
		switch got, err := s.Inspect(ctx, k); {
		case errors.Is(err, storage.ErrNotFound):
		case err != nil:
			t.Fatalf("%s: inspect: %v", st.name, err)
		default:
			pre = &got.Record
		}
		p := st.p()
		written, now, rec, err := postgres.Row(ctx, s, st.name, p)
		require.NoError(t, err, st.name)
		require.True(t, written, "%s: the statement wrote", st.name)
		want, write, err := st.decide(now, pre, p)
		require.NoError(t, err, st.name)
		require.True(t, write, "%s: the rules write", st.name)
		if cp, ok := p.(storage.CompleteParams); ok {
			rec.Result = cp.Result // a written Complete does not send its result back
		}
		if rp, ok := p.(storage.ResolveParams); ok && rp.Complete {
			rec.Result = rp.Result // nor does a written Resolve
		}
		require.Nil(t, rec.History, "%s: the statement does not return the history", st.name)
		stored, err := s.Inspect(ctx, k)
		require.NoError(t, err, st.name)
		rec.History = stored.Record.History
		require.Equal(t, normal(want), normal(rec), st.name)
		token = rec.Token
	}
	got, err := s.Inspect(ctx, k)
	require.NoError(t, err)
	require.Len(t, got.Record.History, storage.MaxHistory, "the steps ran past the bound")
}
