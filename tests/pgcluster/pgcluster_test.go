package pgcluster

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestStopImmediateAndRestart checks the cluster's life cycle: a committed
// row survives an immediate stop (a crash) and the restart's recovery.
func TestStopImmediateAndRestart(t *testing.T) {
	c := Start(t)
	url := c.URL(c.Addr(), "postgres")
	exec := func(sql string) error {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, sql)
		return err
	}
	require.NoError(t, exec(`CREATE TABLE t (v int); INSERT INTO t VALUES (42)`))
	require.NoError(t, c.StopImmediate())
	require.Error(t, exec(`SELECT 1`), "the server is down")
	require.NoError(t, c.Start())
	require.NoError(t, exec(`DO $$ BEGIN IF (SELECT v FROM t) <> 42 THEN RAISE 'lost'; END IF; END $$`))
}
