package main

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client/fence"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestFencedWrite: a write replaces the entry only under a larger token, so
// a takeover overwrites a crashed holder's entry and a stalled holder's late
// write (here with another amount, to show it) is refused with its
// transaction.
func TestFencedWrite(t *testing.T) {
	ctx := t.Context()
	url := pgtest.NewEmptyDatabase(t)
	// Replicas starting at once create the schema once, without racing.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			l, err := openLedger(ctx, url, "replica")
			if assert.NoError(t, err) {
				l.Close()
			}
		})
	}
	wg.Wait()

	l, err := openLedger(ctx, url, "test")
	require.NoError(t, err)
	defer l.Close()
	p := Payment{ID: "pay-1", Account: "acct-1", AmountMinor: 500}

	stalled := Payment{ID: "pay-1", Account: "acct-1", AmountMinor: 700}

	require.NoError(t, l.Apply(ctx, p, 10, 1))
	require.NoError(t, l.Apply(ctx, p, 20, 2), "a takeover rewrites the entry")
	require.ErrorIs(t, l.Apply(ctx, stalled, 10, 1), fence.ErrStale, "the stalled first holder's late write loses")
	require.NoError(t, l.Apply(ctx, stalled, 20, 2), "the same token finds its own entry and writes nothing")

	var entries, balance, token, fenceToken int64
	require.NoError(t, l.db.QueryRow(ctx, `SELECT entries, balance_minor FROM account_balances WHERE account = 'acct-1'`).Scan(&entries, &balance))
	require.NoError(t, l.db.QueryRow(ctx, `SELECT token FROM ledger_entries WHERE payment_id = 'pay-1'`).Scan(&token))
	require.NoError(t, l.db.QueryRow(ctx, `SELECT token FROM ledger_fence WHERE consumer = $1 AND key = 'pay-1'`, consumer).Scan(&fenceToken))
	require.EqualValues(t, 1, entries)
	require.EqualValues(t, 500, balance, "neither refused write landed")
	require.EqualValues(t, 20, token)
	require.EqualValues(t, 20, fenceToken)
}
