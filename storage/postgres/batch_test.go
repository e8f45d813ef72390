package postgres_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestExplicitBatchIsOneStatement: a batch of 100 new keys is one
// statement to claim them and one to complete them, with coalescing on or
// off; the same key twice takes one more.
func TestExplicitBatchIsOneStatement(t *testing.T) {
	db := pgtest.NewDatabase(t)
	for _, tc := range []struct {
		name string
		opts []postgres.Option
	}{
		{"coalescing on", nil},
		{"coalescing off", []postgres.Option{postgres.WithBatching(1, 0, 0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, db, tc.opts...)
			ps := make([]storage.ClaimParams, 100)
			for i := range ps {
				ps[i] = storage.ClaimParams{Key: storage.Key{Consumer: "batch.test", Kind: storage.KindMessage, Key: fmt.Sprintf("%s-%d", tc.name, i)},
					Lease: time.Minute, Retention: time.Hour}
			}
			ps = append(ps, ps[7]) // the same key again: a second round
			batches, calls := postgres.BatchStats(s)
			got := s.ClaimBatch(t.Context(), ps)
			b2, c2 := postgres.BatchStats(s)
			require.EqualValues(t, 1, b2-batches, "one statement for the distinct keys")
			require.EqualValues(t, 100, c2-calls)
			require.Equal(t, storage.OutcomeInProgress, got[100].Result.Outcome, "the repeat sees the first claim")
			cs := make([]storage.CompleteParams, 100)
			for i := range cs {
				require.NoError(t, got[i].Err)
				cs[i] = storage.CompleteParams{Key: ps[i].Key, Token: got[i].Result.Record.Token, Result: []byte("r")}
			}
			for _, a := range s.CompleteBatch(t.Context(), cs) {
				require.NoError(t, a.Err)
			}
			b3, c3 := postgres.BatchStats(s)
			require.EqualValues(t, 1, b3-b2)
			require.EqualValues(t, 100, c3-c2)
		})
	}
}

// TestMixedBatchIsOneTransaction: a batch of Claims and Completes is one
// transaction with one commit: every row it wrote carries the same
// transaction id (xmin). (pg_stat_database's xact_commit would say it too,
// but a backend reports it at most once a second.)
func TestMixedBatchIsOneTransaction(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	if isCockroach(t, databaseURL) {
		t.Skip("xmin and pg_stat_database are PostgreSQL's")
	}
	s := openStore(t, databaseURL)
	ctx := t.Context()
	key := func(i int) storage.Key {
		return storage.Key{Consumer: "mixed.txn", Kind: storage.KindOperation, Key: fmt.Sprint("k-", i)}
	}
	claim := func(i int) *storage.ClaimParams {
		return &storage.ClaimParams{Key: key(i), Lease: time.Minute, Retention: time.Hour, Holder: "h"}
	}
	var ops []storage.Op
	for i := range 4 { // held keys, completed by the batch
		res, err := s.Claim(ctx, *claim(i))
		require.NoError(t, err)
		ops = append(ops, storage.Op{Complete: &storage.CompleteParams{Key: key(i), Token: res.Record.Token, Result: []byte("r")}})
	}
	for i := 4; i < 8; i++ { // fresh keys, claimed by the batch
		ops = append(ops, storage.Op{Claim: claim(i)})
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	mixed0 := postgres.MixedBatches(s)
	got := s.Batch(ctx, ops)
	for i, a := range got {
		require.NoError(t, a.Err, "item %d", i)
	}
	require.EqualValues(t, 1, postgres.MixedBatches(s)-mixed0, "one transaction of both kinds")

	rows, err := conn.Query(ctx, `SELECT DISTINCT xmin::text FROM idemreg_records WHERE consumer = 'mixed.txn'`)
	require.NoError(t, err)
	xids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, xids, 1, "the Claims and the Completes were written by one transaction: %v", xids)

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
