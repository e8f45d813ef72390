//go:build linearizability || chaos

package faults

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/tests/pgcluster"
)

// TestLinearizabilityThroughClientPostgresSIGKILL is
// TestLinearizabilityThroughClientSIGKILL on PostgreSQL: the workload's
// concurrent Claims and Completes go through the Go client, which sends
// them together as Batch RPCs, and the store decides each batch in one
// transaction (issue 36); serve is SIGKILLed twice mid-run.
func TestLinearizabilityThroughClientPostgresSIGKILL(t *testing.T) {
	pg := pgcluster.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	require.NoError(t, postgres.Migrate(ctx, pg.URL(pg.Addr(), "postgres")))
	h := newHarnessThrough(t, true, []string{"IDEMREG_DATABASE_URL=" + pg.URL(pg.Addr(), "postgres")})
	h.run()
	const kills = 2
	for i := range kills {
		time.Sleep(phases(kills + 1))
		h.kill()
		began := time.Now()
		h.start()
		h.recovered(fmt.Sprintf("SIGKILL %d", i+1), began)
	}
	time.Sleep(phases(kills + 1))
	h.finish()
}
