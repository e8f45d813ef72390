package retention_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// insertRecords inserts n records of consumer straight into a migrated
// PostgreSQL database, in one INSERT ... SELECT over generate_series, so a
// million rows load in seconds. Keys are key-0 ... key-(n-1); expires is an
// SQL expression of i (the row number) and now() giving expires_at, and
// the lease ends retention (one hour) before it. completed rows hold a small
// result; the others are in progress.
func insertRecords(ctx context.Context, t testing.TB, dbURL, consumer string, n int, completed bool, expires string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	state, result := 1, "NULL"
	if completed {
		state, result = 2, `'\x0a021201'::bytea`
	}
	sql := fmt.Sprintf(`
INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result)
SELECT $1, 1, 'key-' || i, %[1]d, '\x6670'::bytea, 1000 + i, 1, 'fixture',
       e - interval '2 hours', e - interval '1 hour',
       CASE WHEN %[1]d = 2 THEN e - interval '1 hour' END, e, 3600000000, %[2]s
FROM (SELECT i, %[3]s AS e FROM generate_series(0, $2 - 1) AS i) AS g`, state, result, expires)
	tag, err := conn.Exec(ctx, sql, consumer, n)
	require.NoError(t, err)
	require.EqualValues(t, n, tag.RowsAffected())
	_, err = conn.Exec(ctx, `ANALYZE idemreg_records`)
	require.NoError(t, err)
}

// countRecords counts the records of consumer, and those expired by the
// database's clock.
func countRecords(t testing.TB, dbURL, consumer string) (all, expired int) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	require.NoError(t, conn.QueryRow(t.Context(),
		`SELECT count(*), count(*) FILTER (WHERE expires_at <= now()) FROM idemreg_records WHERE consumer = $1`,
		consumer).Scan(&all, &expired))
	return all, expired
}

// tokens returns the token of every record of consumer, by key.
func tokens(t testing.TB, dbURL, consumer string) map[string]int64 {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	rows, err := conn.Query(t.Context(), `SELECT key, token FROM idemreg_records WHERE consumer = $1`, consumer)
	require.NoError(t, err)
	out := map[string]int64{}
	var (
		k   string
		tok int64
	)
	_, err = pgx.ForEachRow(rows, []any{&k, &tok}, func() error { out[k] = tok; return nil })
	require.NoError(t, err)
	return out
}

// pgUpdate runs one statement on the database.
func pgUpdate(ctx context.Context, dbURL, sql string) (int64, error) {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(ctx, sql)
	return tag.RowsAffected(), err
}
