package postgres_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestSmallBatchesArePlannedOnce: a batched statement of two keys runs
// with the generic plan from its first execution. Left to choose,
// PostgreSQL kept a custom plan for short arrays and planned the statement
// again on every execution, which cost a batch of two more than the two
// single statements it replaced (docs/benchmarks.md, "Small batches").
func TestSmallBatchesArePlannedOnce(t *testing.T) {
	url := pgtest.NewDatabase(t)
	if isCockroach(t, url) {
		t.Skip("CockroachDB keeps its own plan cache; pg_prepared_statements is PostgreSQL's")
	}
	s, err := postgres.Open(t.Context(), url, postgres.WithBatching(1, 0, 0),
		postgres.WithPoolConfig(func(c *pgxpool.Config) { c.MaxConns, c.MinConns = 1, 1 }))
	require.NoError(t, err)
	defer s.Close()
	const rounds = 12
	for r := range rounds {
		claims := make([]storage.ClaimParams, 2)
		for j := range claims {
			claims[j] = storage.ClaimParams{Key: storage.Key{Consumer: "plans", Kind: storage.KindMessage, Key: fmt.Sprintf("r%d-%d", r, j)},
				Lease: time.Minute, Retention: time.Hour, Holder: "h"}
		}
		completes := make([]storage.CompleteParams, 0, len(claims))
		for j, a := range s.ClaimBatch(t.Context(), claims) {
			require.NoError(t, a.Err)
			require.Equal(t, storage.OutcomeAcquired, a.Result.Outcome)
			completes = append(completes, storage.CompleteParams{Key: claims[j].Key, Token: a.Result.Record.Token, Result: []byte("ok")})
		}
		for _, a := range s.CompleteBatch(t.Context(), completes) {
			require.NoError(t, a.Err)
		}
	}
	generic, custom := postgres.BatchPlans(t, s)
	assert.Zero(t, custom, "custom plans of the batched statements (each one is a planning on the request path)")
	assert.EqualValues(t, 2*rounds, generic, "executions with the generic plan")
}
