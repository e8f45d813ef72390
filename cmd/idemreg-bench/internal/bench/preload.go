package bench

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// PreloadConsumer owns the records Preload loads.
const PreloadConsumer = "bench.preload"

// PreloadKey is the key of preloaded record i.
func PreloadKey(i int) string { return "pre-" + strconv.Itoa(i) }

// preloadSQL loads records $1 < i <= $2 as completed KIND_MESSAGE records
// of PreloadConsumer, expiring in 30 days, holding the encoded result $4,
// in one statement.
const preloadSQL = `
INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result)
SELECT $3, 1, 'pre-' || i, 2, '\x'::bytea, 1, 1, 'preload',
    now(), now(), now(), now() + INTERVAL '30 days', 2592000000000, CAST($4 AS BYTEA)
FROM generate_series(CAST($1 AS BIGINT), CAST($2 AS BIGINT)) AS i
ON CONFLICT DO NOTHING`

// Preload makes sure the registry's table at databaseURL holds n preloaded
// records (keys PreloadKey(0) to PreloadKey(n-1)), inserting the missing
// ones with one INSERT ... SELECT generate_series, and returns how many it
// inserted and the table's row count.
func Preload(ctx context.Context, databaseURL string, n int) (inserted, total int64, err error) {
	conn, err := connect(ctx, databaseURL)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(context.Background())
	var have int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM idemreg_records WHERE consumer = $1`, PreloadConsumer).Scan(&have); err != nil {
		return 0, 0, fmt.Errorf("counting preloaded records (has migrate run?): %w", err)
	}
	if have < int64(n) {
		// Keys are dense from 0, so the missing ones are the top of the range.
		result, err := proto.Marshal(&idemregv1.Result{Outcome: &idemregv1.Result_Response{
			Response: &idemregv1.Response{Type: "bench.v1.Done", Data: []byte("preloaded")}}})
		if err != nil {
			return 0, 0, err
		}
		tag, err := conn.Exec(ctx, preloadSQL, have, int64(n)-1, PreloadConsumer, result)
		if err != nil {
			return 0, 0, fmt.Errorf("preloading: %w", err)
		}
		inserted = tag.RowsAffected()
		if _, err := conn.Exec(ctx, `ANALYZE idemreg_records`); err != nil {
			return inserted, 0, err
		}
	}
	err = conn.QueryRow(ctx, `SELECT count(*) FROM idemreg_records`).Scan(&total)
	return inserted, total, err
}

// DBCommits reads the database's committed transactions so far. The
// statistics lag by up to a second (backends flush them when idle).
func DBCommits(ctx context.Context, databaseURL string) (int64, error) {
	conn, err := connect(ctx, databaseURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int64
	err = conn.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// settleStats waits for the statistics of idle backends to be flushed.
func settleStats(ctx context.Context) { sleep(ctx, 1500*time.Millisecond) }

// BackendPIDs lists the process ids of the sessions on databaseURL's
// database whose application_name is app, to read their CPU time.
func BackendPIDs(ctx context.Context, databaseURL, app string) ([]int, error) {
	conn, err := connect(ctx, databaseURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1`, app)
	if err != nil {
		return nil, err
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	out := make([]int, len(pids))
	for i, p := range pids {
		out[i] = int(p)
	}
	return out, err
}

// connect opens one connection to databaseURL, which may carry the pool
// settings (pool_max_conns, ...) that the server's URL takes.
func connect(ctx context.Context, databaseURL string) (*pgx.Conn, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	return pgx.ConnectConfig(ctx, cfg.ConnConfig)
}
