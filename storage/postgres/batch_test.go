package postgres_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestBatcherConformance(t *testing.T) {
	storagetest.RunBatcher(t, sharedDatabase(pgtest.NewDatabase(t)))
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
