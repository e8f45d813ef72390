package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// countingPool limits the store's pool to maxConns connections whose
// network writes are counted in writes.
func countingPool(maxConns int32, writes *atomic.Int64) postgres.Option {
	return postgres.WithPoolConfig(func(cfg *pgxpool.Config) {
		cfg.MaxConns = maxConns
		// pgxpool pings a connection idle for over a second before handing
		// it out; a slow machine must not make that count.
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		var d net.Dialer
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return writeCountingConn{Conn: conn, n: writes}, nil
		}
	})
}

// queryCounter counts the statements pgx sends.
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A batch's statements count one each.
func (c *queryCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	c.n.Add(int64(data.Batch.Len()))
	return ctx
}

func (c *queryCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// writeCountingConn counts the writes to the server: pgx sends everything a
// statement needs in one write, so a second write would be a second round
// trip (a Parse/Describe before the execution, say).
type writeCountingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c writeCountingConn) Write(b []byte) (int, error) {
	c.n.Add(1)
	return c.Conn.Write(b)
}

// TestOneRoundTripPerCall counts statements (with a pgx tracer) and writes
// on the connection for each kind of call made alone: each is one
// statement, sent in one write, from its first use on a connection.
// Concurrent calls share statements: TestOneStatementPerBatch counts one
// statement and one write per batch.
func TestOneRoundTripPerCall(t *testing.T) {
	var (
		queries queryCounter
		writes  atomic.Int64
		clock   storagetest.Clock
	)
	s := openStore(t, pgtest.NewDatabase(t),
		postgres.WithClockOffset(clock.Offset),
		postgres.WithTracer(&queries),
		countingPool(1, &writes))
	require.NoError(t, s.Ping(t.Context())) // connects and prepares

	ctx := t.Context()
	k := storage.Key{Consumer: "roundtrip", Kind: storage.KindOperation, Key: "k-1"}
	p := storage.ClaimParams{Key: k, Fingerprint: []byte("fp"), Lease: 10 * time.Second, Retention: time.Hour, Holder: "a"}
	var token int64
	cases := []struct {
		name string
		call func() error
	}{
		{"ClaimNewKey", func() error {
			res, err := s.Claim(ctx, p)
			token = res.Record.Token
			return expectOutcome(res, err, storage.OutcomeAcquired)
		}},
		{"ClaimInProgress", func() error {
			res, err := s.Claim(ctx, p)
			return expectOutcome(res, err, storage.OutcomeInProgress)
		}},
		{"Extend", func() error {
			_, err := s.Extend(ctx, storage.ExtendParams{Key: k, Token: token, Lease: time.Minute})
			return err
		}},
		{"Release", func() error {
			_, err := s.Release(ctx, storage.ReleaseParams{Key: k, Token: token})
			return err
		}},
		{"ClaimTakeover", func() error {
			res, err := s.Claim(ctx, p)
			token = res.Record.Token
			return expectOutcome(res, err, storage.OutcomeAcquired)
		}},
		{"Complete", func() error {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: token, Result: []byte("r")})
			return err
		}},
		{"CompleteRepeated", func() error {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: token, Result: []byte("r")})
			return err
		}},
		{"ClaimReplay", func() error {
			res, err := s.Claim(ctx, p)
			return expectOutcome(res, err, storage.OutcomeCompleted)
		}},
		{"Lookup", func() error {
			_, err := s.Lookup(ctx, k)
			return err
		}},
		{"OldestExpiry", func() error {
			_, _, _, err := s.OldestExpiry(ctx)
			return err
		}},
		{"SweepExpired", func() error {
			_, err := s.SweepExpired(ctx, 100)
			return err
		}},
	}
	for _, tc := range cases {
		q0, w0 := queries.n.Load(), writes.Load()
		require.NoError(t, tc.call(), tc.name)
		q, w := queries.n.Load()-q0, writes.Load()-w0
		t.Logf("%-16s statements=%d writes=%d", tc.name, q, w)
		require.EqualValues(t, 1, q, "%s: statements sent", tc.name)
		require.EqualValues(t, 1, w, "%s: writes to the server", tc.name)
	}
}

// TestOneStatementPerBatch counts statements and writes when calls
// coalesce: the only statement slot of a kind is held by a call of that
// kind waiting on a row lock (a Claim's ON CONFLICT and a Complete's UPDATE
// both lock the row), n calls of the kind queue behind it, and when the
// lock goes they travel as one statement in one write, each with its own
// answer.
func TestOneStatementPerBatch(t *testing.T) {
	const n = 16
	var (
		queries queryCounter
		writes  atomic.Int64
	)
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL,
		postgres.WithTracer(&queries),
		postgres.WithBatching(64, time.Hour, 1),
		countingPool(2, &writes))
	ctx := t.Context()
	lock, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	defer lock.Close(context.Background())

	// round runs call(i) for i < n behind a blocked call of the same kind
	// and checks that they took one statement and one write.
	blockers := 0
	round := func(name string, claims bool, call func(i int) error) {
		blockers++
		blocker := storage.Key{Consumer: "batch", Kind: storage.KindOperation, Key: fmt.Sprint("blocker-", blockers)}
		// A lease that has run out by the time the blocked Claim comes: a
		// takeover, which must lock the row (a Claim answered IN_PROGRESS
		// takes no lock and would not block).
		res, err := s.Claim(ctx, storage.ClaimParams{Key: blocker, Lease: time.Microsecond, Retention: time.Hour})
		require.NoError(t, err)
		tx, err := lock.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background()) //nolint:errcheck // released below
		_, err = tx.Exec(ctx, `SELECT 1 FROM idemreg_records WHERE consumer = $1 AND key = $2 FOR UPDATE`, blocker.Consumer, blocker.Key)
		require.NoError(t, err)

		q0, w0 := queries.n.Load(), writes.Load()
		blocked := make(chan error, 1)
		go func() {
			if claims {
				res, err := s.Claim(ctx, storage.ClaimParams{Key: blocker, Lease: time.Minute, Retention: time.Hour})
				blocked <- expectOutcome(res, err, storage.OutcomeAcquired)
				return
			}
			_, err := s.Complete(ctx, storage.CompleteParams{Key: blocker, Token: res.Record.Token, Result: []byte("r")})
			blocked <- err
		}()
		require.Eventually(t, func() bool { return queries.n.Load() == q0+1 && writes.Load() >= w0+1 },
			10*time.Second, time.Millisecond, "%s: the blocking statement was sent", name)
		b0, c0 := postgres.BatchStats(s)
		q0, w0 = queries.n.Load(), writes.Load()

		errs := make(chan error, n)
		for i := range n {
			go func() { errs <- call(i) }()
		}
		require.Eventually(t, func() bool { _, queued := postgres.Coalescing(s); return queued == n },
			10*time.Second, time.Millisecond, "%s: every call queued", name)
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, <-blocked)
		for range n {
			require.NoError(t, <-errs, name)
		}
		b, c := postgres.BatchStats(s)
		q, w := queries.n.Load()-q0, writes.Load()-w0
		t.Logf("%-14s calls=%d statements=%d writes=%d", name, n, q, w)
		require.EqualValues(t, 1, b-b0, "%s: batches", name)
		require.EqualValues(t, n, c-c0, "%s: calls in the batch", name)
		require.EqualValues(t, 1, q, "%s: statements sent for %d calls", name, n)
		require.EqualValues(t, 1, w, "%s: writes to the server for %d calls", name, n)
	}

	key := func(i int) storage.Key {
		return storage.Key{Consumer: "batch", Kind: storage.KindOperation, Key: fmt.Sprintf("k-%02d", i)}
	}
	claim := func(i int) storage.ClaimParams {
		return storage.ClaimParams{Key: key(i), Fingerprint: []byte("fp"), Lease: time.Minute, Retention: time.Hour, Holder: "h"}
	}
	tokens := make([]int64, n)
	round("ClaimNewKeys", true, func(i int) error {
		res, err := s.Claim(ctx, claim(i))
		tokens[i] = res.Record.Token
		if err == nil && res.Record.Key != key(i) {
			return fmt.Errorf("answer for %v, want %v", res.Record.Key, key(i))
		}
		return expectOutcome(res, err, storage.OutcomeAcquired)
	})
	round("ClaimInProgress", true, func(i int) error {
		res, err := s.Claim(ctx, claim(i))
		if err == nil && res.RetryAfter <= 0 {
			return fmt.Errorf("retry after %v", res.RetryAfter)
		}
		return expectOutcome(res, err, storage.OutcomeInProgress)
	})
	round("Complete", false, func(i int) error {
		rec, err := s.Complete(ctx, storage.CompleteParams{Key: key(i), Token: tokens[i], Result: []byte(fmt.Sprint("result-", i))})
		if err == nil && (rec.State != storage.StateCompleted || string(rec.Result) != fmt.Sprint("result-", i)) {
			return fmt.Errorf("record %+v", rec)
		}
		return err
	})
	round("CompleteMixed", false, func(i int) error {
		// Even keys repeat their Complete, odd keys send a stale token.
		p := storage.CompleteParams{Key: key(i), Token: tokens[i], Result: []byte("other")}
		if i%2 == 1 {
			p.Token--
		}
		rec, err := s.Complete(ctx, p)
		switch {
		case i%2 == 1 && !errors.Is(err, storage.ErrLeaseLost):
			return fmt.Errorf("stale token: %v", err)
		case i%2 == 0 && err != nil:
			return err
		case i%2 == 0 && string(rec.Result) != fmt.Sprint("result-", i):
			return fmt.Errorf("the first result stays: got %q", rec.Result)
		}
		return nil
	})
	round("ClaimReplay", true, func(i int) error {
		res, err := s.Claim(ctx, claim(i))
		if err == nil && string(res.Record.Result) != fmt.Sprint("result-", i) {
			return fmt.Errorf("replayed %q", res.Record.Result)
		}
		return expectOutcome(res, err, storage.OutcomeCompleted)
	})
}

func expectOutcome(res storage.ClaimResult, err error, want storage.Outcome) error {
	if err != nil {
		return err
	}
	if res.Outcome != want {
		return fmt.Errorf("outcome %v, want %v", res.Outcome, want)
	}
	return nil
}

// TestClaimWritesOnlyWhenItMust runs the Claim statement in a transaction
// and asks PostgreSQL whether it got a transaction id, which any write or
// row lock assigns: a new key and a takeover must, a replay and an
// in-progress answer must not (no lock, and a commit with nothing to
// flush).
func TestClaimWritesOnlyWhenItMust(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	pgtest.RequirePostgreSQL(t, databaseURL, "it asks pg_current_xact_id_if_assigned() whether a transaction wrote")
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())

	claim := func(key string, leaseMicros int64) (written, xid bool) {
		tx, err := conn.Begin(t.Context())
		require.NoError(t, err)
		defer tx.Rollback(context.Background()) //nolint:errcheck // committed below
		rows, err := tx.Query(t.Context(), postgres.ClaimSQL,
			"plan", int16(storage.KindMessage), key, []byte{}, "h", leaseMicros, int64(3_600_000_000), int64(0), "", int64(0))
		require.NoError(t, err)
		require.True(t, rows.Next())
		vals, err := rows.Values()
		require.NoError(t, err)
		written = vals[1].(bool) // after the ordinal
		rows.Close()
		require.NoError(t, rows.Err())
		require.NoError(t, tx.QueryRow(t.Context(), `SELECT pg_current_xact_id_if_assigned() IS NOT NULL`).Scan(&xid))
		require.NoError(t, tx.Commit(t.Context()))
		return written, xid
	}
	written, xid := claim("k", 10_000_000)
	require.True(t, written && xid, "a new key is inserted")
	written, xid = claim("k", 10_000_000)
	require.False(t, written || xid, "in progress: nothing written, nothing locked")

	written, xid = claim("gone", 1) // a lease of 1 µs, over by the next statement
	require.True(t, written && xid)
	written, xid = claim("gone", 10_000_000)
	require.True(t, written && xid, "a takeover writes")

	_, err = conn.Exec(t.Context(), `UPDATE idemreg_records SET state = 2, completed_at = now(), result = '\x00' WHERE key = 'k'`)
	require.NoError(t, err)
	written, xid = claim("k", 10_000_000)
	require.False(t, written || xid, "a replay: nothing written, nothing locked")

	written, xid = claim("spent", 1) // its lease is over by the next statement, as for "gone"
	require.True(t, written && xid)
	_, err = conn.Exec(t.Context(), `UPDATE idemreg_records SET state = 3, park_reason = 'r' WHERE key = 'spent'`)
	require.NoError(t, err)
	written, xid = claim("spent", 10_000_000)
	require.False(t, written || xid, "parked, lease over: nothing written, nothing locked")
}
