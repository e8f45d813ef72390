package postgres_test

import (
	"context"
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

func TestBatcherConformance(t *testing.T) {
	storagetest.RunBatcher(t, sharedDatabase(pgtest.NewDatabase(t)))
}

func TestMixedBatcherConformance(t *testing.T) {
	storagetest.RunMixedBatcher(t, sharedDatabase(pgtest.NewDatabase(t)))
}

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
