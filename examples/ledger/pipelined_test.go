package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/registrytest"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestPipelinedConsumerKilledMidStream SIGKILLs the one pipelined consumer
// process while it streams through the payments, with Completes held for
// the next Claim and acks waiting on them, and starts another. The held
// Completes die with the process; their messages were never acked, so
// JetStream redelivers them, and the registry hands each over once the
// dead holder's lease runs out. No payment may be missing, none applied
// twice (each entry once, balances exact), and every registry outcome must
// be the one whose write the ledger holds (the same token).
func TestPipelinedConsumerKilledMidStream(t *testing.T) {
	natsURL, js := connectNATS(t)
	ctx := t.Context()
	dbURL := pgtest.NewEmptyDatabase(t)
	reg := registrytest.Start(t)

	suffix := randomSuffix(t)
	stream, subject := "LEDGER_PIPE_"+suffix, "ledger-pipe."+suffix+".payments"
	require.NoError(t, ensureStream(ctx, js, stream, subject))
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })

	bin := filepath.Join(t.TempDir(), "ledger")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	const n = 300
	want := map[string]Payment{}
	balances := map[string]int64{}
	for i := range n {
		p := Payment{ID: fmt.Sprintf("pay-%04d", i), Account: fmt.Sprintf("acct-%d", i%5), AmountMinor: int64(10 + i)}
		want[p.ID] = p
		balances[p.Account] += p.AmountMinor
		data, err := json.Marshal(p)
		require.NoError(t, err)
		_, err = js.Publish(ctx, subject, data)
		require.NoError(t, err)
		if i%4 == 0 { // a duplicate right behind it
			_, err = js.Publish(ctx, subject, data)
			require.NoError(t, err)
		}
	}

	args := []string{
		"-registry", reg.Addr, "-nats", natsURL, "-database", dbURL,
		"-stream", stream, "-subject", subject, "-durable", "ledger", "-mode", "pipelined",
		"-workers", "4", "-batch", "8", "-lease", "1s", "-ack-wait", "1s", "-slow", "2ms",
	}
	first := startReplica(t, bin, "replica-a", args...)

	db, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close(context.Background()) })
	count := func() int {
		var c int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&c); err != nil {
			return -1
		}
		return c
	}
	waitFor(t, "a third of the payments applied", func() bool { return count() >= n/3 })
	first.kill(t)
	atKill := count()
	require.Less(t, atKill, n, "killed mid-stream")

	// What the registry has completed at the kill: every other applied
	// payment was in the window (handled, its Complete held or in flight).
	completedAtKill := 0
	for id := range want {
		rec, err := reg.Client.Lookup(ctx, client.Key{Consumer: consumer, Kind: client.KindMessage, Key: id})
		if err == nil && rec.State == client.StateCompleted {
			completedAtKill++
		}
	}
	t.Logf("killed replica-a: %d of %d payments in the ledger, %d completed in the registry", atKill, n, completedAtKill)

	second := startReplica(t, bin, "replica-b", args...)
	cons, err := js.Consumer(ctx, stream, "ledger")
	require.NoError(t, err)
	waitFor(t, "every message acknowledged and every payment applied", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && count() == n
	})
	second.stop(t)

	type entry struct {
		p              Payment
		token, attempt int64
	}
	got := map[string]entry{}
	rows, err := db.Query(ctx, `SELECT payment_id, account, amount_minor, token, attempt FROM ledger_entries`)
	require.NoError(t, err)
	for rows.Next() {
		var e entry
		require.NoError(t, rows.Scan(&e.p.ID, &e.p.Account, &e.p.AmountMinor, &e.token, &e.attempt))
		got[e.p.ID] = e
	}
	require.NoError(t, rows.Err())
	require.Len(t, got, n, "no payment lost")
	retaken := 0
	for id, p := range want {
		require.Equal(t, p, got[id].p, "entry of %s", id)
		if got[id].attempt > 1 {
			retaken++
		}
		// The outcome the registry replays is the one the ledger holds.
		rec, err := reg.Client.Lookup(ctx, client.Key{Consumer: consumer, Kind: client.KindMessage, Key: id})
		require.NoError(t, err)
		require.Equal(t, client.StateCompleted, rec.State, id)
		require.Equal(t, got[id].token, rec.Token, "the completed token of %s wrote its entry", id)
	}
	gotBalances := map[string]int64{}
	rows, err = db.Query(ctx, `SELECT account, balance_minor FROM account_balances`)
	require.NoError(t, err)
	for rows.Next() {
		var acct string
		var bal int64
		require.NoError(t, rows.Scan(&acct, &bal))
		gotBalances[acct] = bal
	}
	require.NoError(t, rows.Err())
	require.Equal(t, balances, gotBalances, "no payment applied twice")
	t.Logf("%d payments applied again after the takeover of the dead replica's claims", retaken)
}
