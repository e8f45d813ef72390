package postgres_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
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

const envCockroachURL = "IDEMREG_TEST_COCKROACH_URL"

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

func openStore(t *testing.T, databaseURL string, opts ...postgres.Option) *postgres.Store {
	t.Helper()
	s, err := postgres.Open(t.Context(), databaseURL, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// sharedDatabase serves every case of storagetest.Run: its keys are unique.
func sharedDatabase(databaseURL string) storagetest.Factory {
	return func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openStore(t, databaseURL, postgres.WithClockOffset(c.Offset))
	}
}

// freshDatabases gives every case a database of its own, for
// storagetest.RunSweeper, whose cases count deletions.
func freshDatabases(serverURL string) storagetest.Factory {
	return func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openStore(t, pgtest.NewDatabaseAt(t, serverURL), postgres.WithClockOffset(c.Offset))
	}
}

func TestConformance(t *testing.T) {
	storagetest.Run(t, sharedDatabase(pgtest.NewDatabase(t)))
}

func TestSweeperConformance(t *testing.T) {
	storagetest.RunSweeper(t, freshDatabases(pgtest.ServerURL()))
}

func TestWaitMarkerConformance(t *testing.T) {
	storagetest.RunWaitMarker(t, sharedDatabase(pgtest.NewDatabase(t)))
}

func TestMembershipConformance(t *testing.T) {
	storagetest.RunMembership(t, freshDatabases(pgtest.ServerURL()))
}

func TestCockroach(t *testing.T) {
	serverURL := os.Getenv(envCockroachURL)
	if serverURL == "" {
		t.Skip(envCockroachURL + " not set: CockroachDB conformance not run (no cluster on this machine)")
	}
	t.Run("Conformance", func(t *testing.T) {
		storagetest.Run(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
	})
	t.Run("Sweeper", func(t *testing.T) {
		storagetest.RunSweeper(t, freshDatabases(serverURL))
	})
	t.Run("WaitMarker", func(t *testing.T) {
		storagetest.RunWaitMarker(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
	})
	t.Run("Membership", func(t *testing.T) {
		storagetest.RunMembership(t, freshDatabases(serverURL))
	})
	t.Run("Batcher", func(t *testing.T) {
		storagetest.RunBatcher(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
	})
	t.Run("MixedBatcher", func(t *testing.T) {
		storagetest.RunMixedBatcher(t, sharedDatabase(pgtest.NewDatabaseAt(t, serverURL)))
	})
	t.Run("ClaimKeys", func(t *testing.T) {
		storagetest.RunClaimKeys(t, freshDatabases(serverURL))
	})
}

func isCockroach(t *testing.T, databaseURL string) bool {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var version string
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT version()`).Scan(&version))
	return strings.Contains(version, "CockroachDB")
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
func (c *queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

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

// TestBatchMemberWithStalePreImage makes one Claim of a batch of four meet
// a row its snapshot did not see: another transaction inserts one of its
// keys and commits while the batch waits on that row. At READ COMMITTED the
// batch's conditional write sees the committed row and declines it, with no
// pre-image to explain why; that member runs again alone, and every caller
// gets the answer of the record as it now is: the key the other
// transaction took is IN_PROGRESS, the others ACQUIRED. (At SERIALIZABLE,
// on CockroachDB, the batch fails with 40001 and is split instead.)
func TestBatchMemberWithStalePreImage(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL, postgres.WithBatching(64, time.Hour, 1))
	ctx := t.Context()
	connect := func() *pgx.Conn {
		conn, err := pgx.Connect(ctx, databaseURL)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close(context.Background()) })
		return conn
	}
	other, watch := connect(), connect()
	key := func(name string) storage.Key {
		return storage.Key{Consumer: "split", Kind: storage.KindOperation, Key: name}
	}
	claim := func(k storage.Key) storage.ClaimParams {
		return storage.ClaimParams{Key: k, Lease: time.Minute, Retention: time.Hour, Holder: "batch"}
	}

	// The other transaction inserts "a", and does not commit yet.
	tx, err := other.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	require.NoError(t, err)
	defer tx.Rollback(context.Background()) //nolint:errcheck // committed below
	_, err = tx.Exec(ctx, `INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder,
		created_at, lease_expires_at, completed_at, expires_at, retention_us, result)
		VALUES ($1, $2, $3, 1, '', 1, 1, 'other', now(), now() + INTERVAL '1 hour', NULL, now() + INTERVAL '2 hours', 3600000000, NULL)`,
		"split", int16(storage.KindOperation), "a")
	require.NoError(t, err)

	release := blockSlot(t, s, databaseURL, true)

	names := []string{"a", "b", "c", "d"}
	type answer struct {
		res storage.ClaimResult
		err error
	}
	answers := make([]chan answer, len(names))
	for i, name := range names {
		answers[i] = make(chan answer, 1)
		go func() {
			res, err := s.Claim(ctx, claim(key(name)))
			answers[i] <- answer{res, err}
		}()
	}
	require.Eventually(t, func() bool { _, queued := postgres.Coalescing(s); return queued == len(names) },
		10*time.Second, time.Millisecond, "every claim queued")
	release()

	// The batch waits for the other transaction's row "a"; then that
	// transaction commits.
	waitForLockWaiters(t, watch, 1) // the batch, on the other transaction's row
	require.NoError(t, tx.Commit(ctx))

	for i, name := range names {
		a := <-answers[i]
		want := storage.OutcomeAcquired
		if name == "a" {
			want = storage.OutcomeInProgress
		}
		require.NoError(t, expectOutcome(a.res, a.err, want), name)
		if name == "a" {
			require.Equal(t, "other", a.res.Record.Holder)
		}
	}
	if isCockroach(t, databaseURL) {
		require.Positive(t, postgres.BatchSplits(s), "the batch was split after its serialization failure")
	} else {
		require.Positive(t, postgres.StaleReads(s), "the member with a stale pre-image ran again")
	}
}

// blockSlot holds the store's only statement slot of one kind (Claim, or
// Complete) with a call of that kind waiting on a row another connection
// locked, until release is called. The Claim is a takeover of a lease that
// has run out, which must lock the row (a Claim answered IN_PROGRESS takes
// no lock and would not wait).
func blockSlot(t *testing.T, s *postgres.Store, databaseURL string, claims bool) (release func()) {
	t.Helper()
	ctx := t.Context()
	lock, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	blocker := storage.Key{Consumer: "blocker", Kind: storage.KindOperation, Key: fmt.Sprint(time.Now().UnixNano())}
	p := storage.ClaimParams{Key: blocker, Lease: time.Microsecond, Retention: time.Hour, Holder: "blocker"}
	if !claims {
		p.Lease = time.Minute
	}
	first, err := s.Claim(ctx, p)
	require.NoError(t, err)
	tx, err := lock.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT 1 FROM idemreg_records WHERE consumer = $1 AND key = $2 FOR UPDATE`, blocker.Consumer, blocker.Key)
	require.NoError(t, err)
	blocked := make(chan error, 1)
	go func() {
		if claims {
			p.Lease = time.Minute
			res, err := s.Claim(ctx, p)
			blocked <- expectOutcome(res, err, storage.OutcomeAcquired)
			return
		}
		_, err := s.Complete(ctx, storage.CompleteParams{Key: blocker, Token: first.Record.Token, Result: []byte("r")})
		blocked <- err
	}()
	require.Eventually(t, func() bool { inFlight, _ := postgres.Coalescing(s); return inFlight == 1 },
		10*time.Second, time.Millisecond)
	return func() {
		t.Helper()
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, <-blocked)
		require.NoError(t, lock.Close(ctx))
	}
}

// waitForLockWaiters waits until n sessions of the database wait on a
// lock: PostgreSQL reports them in pg_stat_activity, CockroachDB in
// crdb_internal.cluster_locks (the documented table of its lock table's
// holders and waiters; not run here, as no cluster is).
func waitForLockWaiters(t *testing.T, watch *pgx.Conn, n int) {
	t.Helper()
	query := `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`
	if isCockroach(t, watch.Config().ConnString()) {
		query = `SELECT count(*) FROM crdb_internal.cluster_locks
			WHERE database_name = current_database() AND NOT granted`
	}
	require.Eventually(t, func() bool {
		var waiting int
		err := watch.QueryRow(t.Context(), query).Scan(&waiting)
		return err == nil && waiting == n
	}, 10*time.Second, time.Millisecond, "%d sessions wait on a lock", n)
}

// TestStalePreImageRunsAgain races each kind of single-row statement with
// a transaction that changed its row and commits while the statement waits
// for the row lock. At READ COMMITTED the statement's conditional write
// sees the committed row, its pre-image is the older version; the store
// sees that the rules would have written that version, runs the statement
// again, and answers from the row as it now is. This is the race that READ
// COMMITTED adds over SERIALIZABLE (doc.go, "Isolation").
func TestStalePreImageRunsAgain(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	if isCockroach(t, databaseURL) {
		t.Skip("CockroachDB sessions run at SERIALIZABLE")
	}
	s := openStore(t, databaseURL, postgres.WithBatching(1, 0, 1))
	ctx := t.Context()
	other, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	defer other.Close(context.Background())
	watch, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	defer watch.Close(context.Background())

	// takeOver makes the other connection take the key over (a new token,
	// holder "other", a live lease) without committing yet.
	takeOver := func(k storage.Key) pgx.Tx {
		tx, err := other.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `UPDATE idemreg_records SET token = token + 1, attempt = attempt + 1, holder = 'other',
			lease_expires_at = now() + INTERVAL '1 hour', expires_at = now() + INTERVAL '2 hours'
			WHERE consumer = $1 AND kind = $2 AND key = $3`, k.Consumer, int16(k.Kind), k.Key)
		require.NoError(t, err)
		return tx
	}
	cases := []struct {
		name  string
		lease time.Duration // of the record before the takeover
		call  func(k storage.Key, token int64) error
	}{
		{"Claim", time.Microsecond, func(k storage.Key, _ int64) error {
			res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Lease: time.Minute, Retention: time.Hour, Holder: "late"})
			if err == nil && res.Record.Holder != "other" {
				return fmt.Errorf("holder %q", res.Record.Holder)
			}
			return expectOutcome(res, err, storage.OutcomeInProgress)
		}},
		{"Complete", time.Minute, func(k storage.Key, token int64) error {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: token, Result: []byte("stale")})
			if !errors.Is(err, storage.ErrLeaseLost) {
				return fmt.Errorf("complete: %v, want ErrLeaseLost", err)
			}
			return nil
		}},
		{"Extend", time.Minute, func(k storage.Key, token int64) error {
			_, err := s.Extend(ctx, storage.ExtendParams{Key: k, Token: token})
			if !errors.Is(err, storage.ErrLeaseLost) {
				return fmt.Errorf("extend: %v, want ErrLeaseLost", err)
			}
			return nil
		}},
		{"Release", time.Minute, func(k storage.Key, token int64) error {
			_, err := s.Release(ctx, storage.ReleaseParams{Key: k, Token: token})
			if !errors.Is(err, storage.ErrLeaseLost) {
				return fmt.Errorf("release: %v, want ErrLeaseLost", err)
			}
			return nil
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			k := storage.Key{Consumer: "stale", Kind: storage.KindOperation, Key: tc.name}
			first, err := s.Claim(ctx, storage.ClaimParams{Key: k, Lease: tc.lease, Retention: time.Hour, Holder: "first"})
			require.NoError(t, err)
			tx := takeOver(k)
			stale0 := postgres.StaleReads(s)
			done := make(chan error, 1)
			go func() { done <- tc.call(k, first.Record.Token) }()
			waitForLockWaiters(t, watch, 1)
			require.NoError(t, tx.Commit(ctx))
			require.NoError(t, <-done)
			require.Greater(t, postgres.StaleReads(s), stale0, "the statement ran again")
			rec, err := s.Lookup(ctx, k)
			require.NoError(t, err)
			require.Equal(t, "other", rec.Holder, "the other transaction's row is untouched")
			require.Equal(t, first.Record.Token+1, rec.Token)
			require.Equal(t, storage.StateInProgress, rec.State)
		})
	}
}

// TestBatchMemberRefused sends a batch of Claims one of which PostgreSQL
// refuses (a NUL byte in its holder: SQLSTATE 22021). That member gets its
// own error; the others are sent again without it and acquire their keys.
func TestBatchMemberRefused(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL, postgres.WithBatching(64, time.Hour, 1))
	ctx := t.Context()
	release := blockSlot(t, s, databaseURL, true)
	const n, bad = 8, 5
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			p := storage.ClaimParams{Key: storage.Key{Consumer: "refused", Kind: storage.KindMessage, Key: fmt.Sprint("k-", i)},
				Lease: time.Minute, Retention: time.Hour, Holder: "good"}
			if i == bad {
				p.Holder = "bad\x00holder"
			}
			res, err := s.Claim(ctx, p)
			errs[i] = expectOutcome(res, err, storage.OutcomeAcquired)
		})
	}
	require.Eventually(t, func() bool { _, queued := postgres.Coalescing(s); return queued == n },
		10*time.Second, time.Millisecond, "every claim queued")
	release()
	wg.Wait()
	for i, err := range errs {
		if i == bad {
			require.ErrorIs(t, err, storage.ErrUnavailable)
			require.Contains(t, err.Error(), "22021")
			continue
		}
		require.NoError(t, err, "claim %d", i)
	}
	splits, _ := postgres.MemberSplits(s)
	require.Positive(t, splits)
	_, err := s.Lookup(ctx, storage.Key{Consumer: "refused", Kind: storage.KindMessage, Key: fmt.Sprint("k-", bad)})
	require.ErrorIs(t, err, storage.ErrNotFound)
}

// TestBatchBytesBound completes 12 keys with results of 1 MiB at once: no
// batched statement carries more than postgres.DefaultBatchBytes of
// parameters, and every result is stored whole.
func TestBatchBytesBound(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL, postgres.WithBatching(64, time.Hour, 1))
	ctx := t.Context()
	const n = 12
	keys := make([]storage.Key, n)
	tokens := make([]int64, n)
	for i := range n {
		keys[i] = storage.Key{Consumer: "big", Kind: storage.KindOperation, Key: fmt.Sprint("k-", i)}
		res, err := s.Claim(ctx, storage.ClaimParams{Key: keys[i], Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		tokens[i] = res.Record.Token
	}
	result := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i)}, 1<<20) }
	release := blockSlot(t, s, databaseURL, false)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, errs[i] = s.Complete(ctx, storage.CompleteParams{Key: keys[i], Token: tokens[i], Result: result(i)})
		})
	}
	require.Eventually(t, func() bool {
		batches, calls := postgres.BatchStats(s)
		_, queued := postgres.Coalescing(s)
		return queued == n || batches > 0 && int(calls)+queued >= n
	}, 10*time.Second, time.Millisecond)
	release()
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "complete %d", i)
		rec, err := s.Lookup(ctx, keys[i])
		require.NoError(t, err)
		require.Equal(t, result(i), rec.Result)
	}
	batches, _ := postgres.BatchStats(s)
	_, largest := postgres.MemberSplits(s)
	t.Logf("batches=%d largest=%d bytes", batches, largest)
	require.Positive(t, batches, "the Completes coalesced")
	require.LessOrEqual(t, largest, int64(postgres.DefaultBatchBytes))
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

func TestMigrateTwiceIsNoOp(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t) // migrated once
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())

	type row struct {
		Name      string
		Variant   string
		AppliedAt time.Time
	}
	applied := func() []row {
		rows, err := conn.Query(t.Context(), `SELECT name, variant, applied_at FROM idemreg_schema_migrations ORDER BY name`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
		require.NoError(t, err)
		return out
	}
	first := applied()
	require.Len(t, first, 9)
	require.Equal(t, "0001_records.sql", first[0].Name)
	require.Equal(t, "0002_expires_at_index.sql", first[1].Name)
	require.Equal(t, "0003_request_id.sql", first[2].Name)
	require.Equal(t, "0004_lease_us.sql", first[3].Name)
	require.Equal(t, "0005_secrets.sql", first[4].Name)
	require.Equal(t, "0006_parking.sql", first[5].Name)
	require.Equal(t, "0007_history_and_parked_index.sql", first[6].Name)
	require.Equal(t, "0008_claim_keys.sql", first[7].Name)

	require.NoError(t, postgres.Migrate(t.Context(), databaseURL))
	require.Equal(t, first, applied(), "a second Migrate applies nothing")

	// A crash between a migration and its bookkeeping runs it again.
	_, err = conn.Exec(t.Context(), `DELETE FROM idemreg_schema_migrations`)
	require.NoError(t, err)
	require.NoError(t, postgres.Migrate(t.Context(), databaseURL), "migrations are safe to repeat")
	require.Len(t, applied(), 9)
}

// closedPortURL is a database URL nothing listens at.
func closedPortURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return "postgres://idemreg:secret@" + addr + "/idemreg?sslmode=disable"
}

func TestUnreachableDatabase(t *testing.T) {
	s := openStore(t, closedPortURL(t))
	// Far more than a refused connection takes; reaching it would mean the
	// store waited instead of failing.
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	k := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}
	calls := []struct {
		name string
		call func() error
	}{
		{"Ping", func() error { return s.Ping(ctx) }},
		{"Claim", func() error {
			_, err := s.Claim(ctx, storage.ClaimParams{Key: k, Lease: time.Second, Retention: time.Hour})
			return err
		}},
		{"Complete", func() error {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: 1, Result: []byte("r")})
			return err
		}},
		{"Lookup", func() error { _, err := s.Lookup(ctx, k); return err }},
		{"SweepExpired", func() error { _, err := s.SweepExpired(ctx, 10); return err }},
	}
	for _, tc := range calls {
		err := tc.call()
		require.ErrorIs(t, err, storage.ErrUnavailable, tc.name)
		require.NotErrorIs(t, err, context.DeadlineExceeded, tc.name)
		require.NotContains(t, err.Error(), "secret", "%s: the password stays out of errors", tc.name)
		require.NotContains(t, err.Error(), "idemreg_records", "%s: SQL stays out of errors", tc.name)
	}
}

func TestContextErrors(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL)
	k := storage.Key{Consumer: "ctx", Kind: storage.KindOperation, Key: "k"}
	p := storage.ClaimParams{Key: k, Lease: time.Minute, Retention: time.Hour, Holder: "a"}

	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := s.Claim(cancelled, p)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, storage.ErrUnavailable)

	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)

	// Another session holds the row, so Complete waits until its deadline.
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	defer tx.Rollback(context.Background()) //nolint:errcheck // the lock's only purpose
	_, err = tx.Exec(t.Context(), `SELECT 1 FROM idemreg_records WHERE consumer = $1 AND key = $2 FOR UPDATE`, k.Consumer, k.Key)
	require.NoError(t, err)

	short, cancelShort := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancelShort()
	_, err = s.Complete(short, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, storage.ErrUnavailable)

	require.NoError(t, tx.Rollback(t.Context()))
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")})
	require.NoError(t, err, "the store recovers once the row is free")
}

func TestOpenRejectsBadURL(t *testing.T) {
	_, err := postgres.Open(t.Context(), "postgres://idemreg:secret@127.0.0.1:notaport/idemreg")
	require.Error(t, err)
	require.NotContains(t, err.Error(), "secret", "the password stays out of errors")
}

// BenchmarkClaimComplete runs claim+complete pairs of new keys from 64
// goroutines on the store, with coalescing on (the default) and off, and
// reports pairs per second and the calls per statement. It prints figures
// and asserts none.
func BenchmarkClaimComplete(b *testing.B) {
	databaseURL := pgtest.NewDatabase(b)
	for _, bc := range []struct {
		name string
		opts []postgres.Option
	}{
		{"coalesced", nil},
		{"alone", []postgres.Option{postgres.WithBatching(1, 0, 0)}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := postgres.Open(b.Context(), databaseURL, bc.opts...)
			require.NoError(b, err)
			defer s.Close()
			var seq atomic.Int64
			prefix := fmt.Sprintf("%s-%d-", bc.name, time.Now().UnixNano())
			var b0, c0, s0 int64
			if bc.name != "alone" {
				b0, c0 = postgres.BatchStats(s)
				s0 = postgres.BatchSplits(s)
			}
			b.SetParallelism((64 + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					k := storage.Key{Consumer: "bench", Kind: storage.KindMessage, Key: prefix + strconv.FormatInt(seq.Add(1), 10)}
					res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Fingerprint: []byte("fp"), Lease: time.Minute, Retention: time.Hour, Holder: "bench"})
					if err != nil {
						b.Error(err)
						return
					}
					if _, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("a small result")}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
			if bc.name != "alone" {
				batches, calls := postgres.BatchStats(s)
				b.ReportMetric(float64(calls-c0)/float64(max(batches-b0, 1)), "calls/batch")
				b.ReportMetric(float64(batches-b0), "batches")
				b.ReportMetric(float64(postgres.BatchSplits(s)-s0), "splits")
			}
		})
	}
}

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
