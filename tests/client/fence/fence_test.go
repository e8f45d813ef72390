package fence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // the database/sql driver the tests use
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client/fence"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// domain is the caller's own table: one row per key, written with a plain
// upsert. Only the fence, applied in the same transaction, keeps a stale
// holder from overwriting it. writes logs every committed write, in commit
// order (a write's id is taken after its Apply, which waits for any
// earlier holder of the key to finish).
const domain = `
CREATE TABLE domain (key text PRIMARY KEY, token bigint NOT NULL, writer text NOT NULL);
CREATE TABLE writes (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
`

func openDB(t *testing.T) (*sql.DB, *fence.Fence) {
	t.Helper()
	url := pgtest.NewEmptyDatabase(t)
	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	f, err := fence.New("fence")
	require.NoError(t, err)
	_, err = db.ExecContext(t.Context(), f.Schema())
	require.NoError(t, err)
	_, err = db.ExecContext(t.Context(), f.Schema())
	require.NoError(t, err, "the DDL may run again")
	_, err = db.ExecContext(t.Context(), domain)
	require.NoError(t, err)
	return db, f
}

const consumer = "ledger.payments"

// write is a handler's transaction: the fence, then the domain write,
// committed only when the fence allowed it.
func write(ctx context.Context, db *sql.DB, f *fence.Fence, opts *sql.TxOptions, key string, token int64, writer string) error {
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := f.Apply(ctx, tx, consumer, key, token); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `
		INSERT INTO domain (key, token, writer) VALUES ($1, $2, $3)
		ON CONFLICT (key) DO UPDATE SET token = excluded.token, writer = excluded.writer`,
		key, token, writer); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO writes (key, token) VALUES ($1, $2)`, key, token); err != nil {
		return err
	}
	return tx.Commit()
}

func fenceToken(t *testing.T, db *sql.DB, key string) (int64, bool) {
	t.Helper()
	var token int64
	err := db.QueryRowContext(t.Context(), `SELECT token FROM fence WHERE consumer = $1 AND key = $2`, consumer, key).Scan(&token)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, false
	}
	require.NoError(t, err)
	return token, true
}

func domainRow(t *testing.T, db *sql.DB, key string) (int64, string, bool) {
	t.Helper()
	var token int64
	var writer string
	err := db.QueryRowContext(t.Context(), `SELECT token, writer FROM domain WHERE key = $1`, key).Scan(&token, &writer)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, "", false
	}
	require.NoError(t, err)
	return token, writer, true
}

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		name, table, quoted string
		ok                  bool
	}{
		{name: "plain", table: "ledger_fence", quoted: `"ledger_fence"`, ok: true},
		{name: "schema qualified", table: "app.fence_1", quoted: `"app"."fence_1"`, ok: true},
		{name: "a keyword is quoted", table: "order", quoted: `"order"`, ok: true},
		{name: "empty", table: ""},
		{name: "empty schema", table: ".fence"},
		{name: "three parts", table: "a.b.c"},
		{name: "upper case", table: "Fence"},
		{name: "leading digit", table: "1fence"},
		{name: "quote", table: `fence"; DROP TABLE domain; --`},
		{name: "space", table: "my fence"},
		{name: "hyphen", table: "my-fence"},
		{name: "non-ASCII", table: "fencé"},
		{name: "too long", table: "a" + fmt.Sprintf("%063d", 0)},
		{name: "63 bytes", table: "a" + fmt.Sprintf("%062d", 0), quoted: `"a` + fmt.Sprintf("%062d", 0) + `"`, ok: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := fence.New(tc.table)
			if !tc.ok {
				require.Error(t, err)
				require.Nil(t, f)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.quoted, f.Table())
			require.Contains(t, f.Schema(), "CREATE TABLE IF NOT EXISTS "+tc.quoted)
		})
	}
}

// TestApply walks one key through the cases a holder meets.
func TestApply(t *testing.T) {
	ctx := t.Context()
	db, f := openDB(t)

	t.Run("apply then commit", func(t *testing.T) {
		require.NoError(t, write(ctx, db, f, nil, "k-commit", 10, "a"))
		token, ok := fenceToken(t, db, "k-commit")
		require.True(t, ok)
		require.EqualValues(t, 10, token)
		token, writer, ok := domainRow(t, db, "k-commit")
		require.True(t, ok)
		require.EqualValues(t, 10, token)
		require.Equal(t, "a", writer)
	})

	t.Run("a newer token after a takeover wins", func(t *testing.T) {
		require.NoError(t, write(ctx, db, f, nil, "k-takeover", 10, "crashed"))
		require.NoError(t, write(ctx, db, f, nil, "k-takeover", 20, "takeover"))
		token, _ := fenceToken(t, db, "k-takeover")
		require.EqualValues(t, 20, token)
		_, writer, _ := domainRow(t, db, "k-takeover")
		require.Equal(t, "takeover", writer, "the takeover replaced the crashed holder's write")
	})

	t.Run("a stale token is refused with its domain write", func(t *testing.T) {
		require.NoError(t, write(ctx, db, f, nil, "k-stale", 20, "takeover"))

		// The stalled holder wakes up after the takeover. Its domain
		// write comes first here, to show it goes with the rollback.
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, `UPDATE domain SET token = 10, writer = 'stalled' WHERE key = 'k-stale'`)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, `INSERT INTO writes (key, token) VALUES ('k-stale', 10)`)
		require.NoError(t, err)
		err = f.Apply(ctx, tx, consumer, "k-stale", 10)
		require.ErrorIs(t, err, fence.ErrStale)
		require.NotErrorIs(t, err, fence.ErrAlreadyApplied)
		var stale *fence.StaleError
		require.ErrorAs(t, err, &stale)
		require.Equal(t, fence.StaleError{Consumer: consumer, Key: "k-stale", Token: 10, Applied: 20}, *stale)
		// The transaction is still usable after a refusal.
		var n int
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT count(*) FROM writes WHERE key = 'k-stale'`).Scan(&n))
		require.Equal(t, 2, n)
		require.NoError(t, tx.Rollback())

		_, writer, _ := domainRow(t, db, "k-stale")
		require.Equal(t, "takeover", writer, "the stale write did not land")
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM writes WHERE key = 'k-stale'`).Scan(&n))
		require.Equal(t, 1, n)
		token, _ := fenceToken(t, db, "k-stale")
		require.EqualValues(t, 20, token)
	})

	t.Run("the same token after its commit", func(t *testing.T) {
		require.NoError(t, write(ctx, db, f, nil, "k-again", 10, "first"))
		err := write(ctx, db, f, nil, "k-again", 10, "again")
		require.ErrorIs(t, err, fence.ErrAlreadyApplied, "the holder learns its own write landed")
		require.NotErrorIs(t, err, fence.ErrStale)
		_, writer, _ := domainRow(t, db, "k-again")
		require.Equal(t, "first", writer)
		var n int
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM writes WHERE key = 'k-again'`).Scan(&n))
		require.Equal(t, 1, n, "the retry did not write twice")
	})

	t.Run("the same token after a rollback", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, f.Apply(ctx, tx, consumer, "k-retry", 10))
		require.NoError(t, tx.Rollback())
		_, ok := fenceToken(t, db, "k-retry")
		require.False(t, ok, "a rollback leaves no fence row")

		require.NoError(t, write(ctx, db, f, nil, "k-retry", 10, "retry"), "the holder may retry its own transaction")
		_, writer, _ := domainRow(t, db, "k-retry")
		require.Equal(t, "retry", writer)
	})

	t.Run("a rolled-back takeover leaves the old token", func(t *testing.T) {
		require.NoError(t, write(ctx, db, f, nil, "k-rollback", 10, "first"))
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, f.Apply(ctx, tx, consumer, "k-rollback", 20))
		require.NoError(t, tx.Rollback())
		token, _ := fenceToken(t, db, "k-rollback")
		require.EqualValues(t, 10, token)
		require.NoError(t, write(ctx, db, f, nil, "k-rollback", 15, "second"), "15 is newer than what committed")
	})

	t.Run("consumers are fenced apart", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, f.Apply(ctx, tx, "other.consumer", "k-commit", 1))
		require.NoError(t, tx.Commit())
	})

	t.Run("invalid arguments", func(t *testing.T) {
		for _, tc := range []struct {
			name, consumer, key string
			token               int64
		}{
			{name: "zero token", consumer: consumer, key: "k", token: 0},
			{name: "negative token", consumer: consumer, key: "k", token: -1},
			{name: "empty key", consumer: consumer, key: "", token: 1},
			{name: "empty consumer", consumer: "", key: "k", token: 1},
		} {
			t.Run(tc.name, func(t *testing.T) {
				tx, err := db.BeginTx(ctx, nil)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback() }()
				err = f.Apply(ctx, tx, tc.consumer, tc.key, tc.token)
				require.Error(t, err)
				require.NotErrorIs(t, err, fence.ErrStale)
			})
		}
		require.Error(t, f.Apply(ctx, nil, consumer, "k", 1))
	})
}

// pgxTx is the adapter a pgx user writes (examples/ledger has the same).
type pgxTx struct{ pgx.Tx }

func (t pgxTx) QueryRow(ctx context.Context, q string, args ...any) fence.Row {
	return t.Tx.QueryRow(ctx, q, args...)
}

// TestApplyWithPgx: the same decisions through pgx, whose "no rows" error
// is not database/sql's.
func TestApplyWithPgx(t *testing.T) {
	ctx := t.Context()
	url := pgtest.NewEmptyDatabase(t)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	f, err := fence.New("fence")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, f.Schema())
	require.NoError(t, err)

	apply := func(token int64) error {
		return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			return f.ApplyWith(ctx, pgxTx{tx}, consumer, "k", token)
		})
	}
	require.NoError(t, apply(10))
	require.NoError(t, apply(20))
	require.ErrorIs(t, apply(10), fence.ErrStale)
	require.ErrorIs(t, apply(20), fence.ErrAlreadyApplied)
}

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40001"
}

// TestConcurrentApply races two holders of each key, a stalled one (token
// 1) and its takeover (token 2), in two transactions started together.
// Whatever the commit order, the takeover's write is the one that stays,
// it is never refused, and the stalled holder's write commits only if it
// committed before the takeover applied (it is then replaced).
func TestConcurrentApply(t *testing.T) {
	const keys = 150
	for _, tc := range []struct {
		name string
		opts *sql.TxOptions
	}{
		{name: "read committed", opts: nil},
		{name: "serializable", opts: &sql.TxOptions{Isolation: sql.LevelSerializable}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			db, f := openDB(t)
			db.SetMaxOpenConns(8)

			// A holder retries its transaction after a serialization
			// failure, as any SERIALIZABLE client must.
			run := func(key string, token int64, writer string) error {
				for {
					err := write(ctx, db, f, tc.opts, key, token, writer)
					if !isSerializationFailure(err) {
						return err
					}
				}
			}
			stalledErrs := make([]error, keys)
			var wg sync.WaitGroup
			for i := range keys {
				key := fmt.Sprintf("k-%03d", i)
				start := make(chan struct{})
				var takeoverErr error
				var pair sync.WaitGroup
				pair.Go(func() { <-start; stalledErrs[i] = run(key, 1, "stalled") })
				pair.Go(func() { <-start; takeoverErr = run(key, 2, "takeover") })
				wg.Go(func() {
					close(start)
					pair.Wait()
					if takeoverErr != nil {
						t.Errorf("%s: the takeover was refused: %v", key, takeoverErr)
					}
				})
			}
			wg.Wait()

			committedFirst := 0
			for i := range keys {
				key := fmt.Sprintf("k-%03d", i)
				token, _ := fenceToken(t, db, key)
				require.EqualValues(t, 2, token, key)
				token, writer, _ := domainRow(t, db, key)
				require.EqualValues(t, 2, token, key)
				require.Equal(t, "takeover", writer, key)

				rows, err := db.QueryContext(ctx, `SELECT token FROM writes WHERE key = $1 ORDER BY id`, key)
				require.NoError(t, err)
				var order []int64
				for rows.Next() {
					var tok int64
					require.NoError(t, rows.Scan(&tok))
					order = append(order, tok)
				}
				require.NoError(t, rows.Err())
				if err := stalledErrs[i]; err != nil {
					require.ErrorIs(t, err, fence.ErrStale, key)
					require.Equal(t, []int64{2}, order, "%s: the refused write did not land", key)
				} else {
					committedFirst++
					require.Equal(t, []int64{1, 2}, order, "%s: the stalled write committed before the takeover applied", key)
				}
			}
			// Both orders should occur; the count shows whether they did.
			t.Logf("%d of %d stalled holders committed before their takeover", committedFirst, keys)
		})
	}
}
