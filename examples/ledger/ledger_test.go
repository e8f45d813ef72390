package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/registrytest"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// EnvNATSURL overrides the NATS server of the end-to-end test.
const EnvNATSURL = "IDEMREG_TEST_NATS_URL"

const natsHelp = `%s
The end-to-end test of examples/ledger needs NATS with JetStream at %s.
Start the machine's NATS server with:
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
or set %s to the URL of another server with JetStream enabled.`

func connectNATS(t *testing.T) (string, jetstream.JetStream) {
	t.Helper()
	url := os.Getenv(EnvNATSURL)
	if url == "" {
		url = "nats://127.0.0.1:4222"
	}
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second), nats.Name("ledger e2e test"))
	if err != nil {
		t.Fatalf(natsHelp, "NATS is not reachable: "+err.Error(), url, EnvNATSURL)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	if _, err := js.AccountInfo(t.Context()); err != nil {
		t.Fatalf(natsHelp, "NATS answers but JetStream does not (is the server started with -js?): "+err.Error(), url, EnvNATSURL)
	}
	return url, js
}

// replica is a ledger consumer running as its own process.
type replica struct {
	name string
	cmd  *exec.Cmd
	out  syncBuffer
	done chan error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func startReplica(t *testing.T, bin, name string, args ...string) *replica {
	t.Helper()
	r := &replica{name: name, done: make(chan error, 1)}
	r.cmd = exec.Command(bin, append([]string{"-name", name}, args...)...)
	r.cmd.Stdout, r.cmd.Stderr = &r.out, &r.out
	require.NoError(t, r.cmd.Start())
	go func() { r.done <- r.cmd.Wait() }()
	t.Cleanup(func() {
		_ = r.cmd.Process.Kill()
		<-r.done
		if t.Failed() {
			t.Logf("output of %s:\n%s", name, r.out.String())
		}
	})
	return r
}

// kill crashes the replica: SIGKILL, no chance to ack, release or complete.
func (r *replica) kill(t *testing.T) {
	t.Helper()
	require.NoError(t, r.cmd.Process.Signal(syscall.SIGKILL))
	err := <-r.done
	r.done <- err // for the cleanup
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
}

// stop asks the replica to stop and requires a clean exit.
func (r *replica) stop(t *testing.T) {
	t.Helper()
	require.NoError(t, r.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-r.done:
		r.done <- err
		require.NoError(t, err, "%s did not stop cleanly:\n%s", r.name, r.out.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not stop after SIGTERM", r.name)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("still waiting for %s after 60s", what)
		}
	}
}

func randomSuffix(t *testing.T) string {
	b := make([]byte, 4)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)
}

// TestLedgerExactlyOnceInEffect runs three replicas of the consumer as
// processes against real NATS JetStream, PostgreSQL and an idemreg
// registry. Payments are published with duplicates; one replica is killed
// with SIGKILL right after its ledger write of a payment and before the
// registry or JetStream heard about it, with more messages in flight;
// JetStream redelivers, the registry hands the payment to another replica
// once the dead one's lease runs out, and the fenced write replaces the
// dead replica's entry instead of adding a second one. The ledger must end
// exactly right. It runs in both modes: client.OnceBatch per fetched batch
// and the pipelined client.Consumer.
func TestLedgerExactlyOnceInEffect(t *testing.T) {
	for _, mode := range []string{"batch", "pipelined"} {
		t.Run(mode, func(t *testing.T) { testLedgerExactlyOnceInEffect(t, mode) })
	}
}

func testLedgerExactlyOnceInEffect(t *testing.T, mode string) {
	natsURL, js := connectNATS(t)
	ctx := t.Context()
	dbURL := pgtest.NewEmptyDatabase(t)
	reg := registrytest.Start(t)

	suffix := randomSuffix(t)
	stream, subject := "LEDGER_E2E_"+suffix, "ledger-e2e."+suffix+".payments"
	require.NoError(t, ensureStream(ctx, js, stream, subject))
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })

	bin := filepath.Join(t.TempDir(), "ledger")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	const stalled = "pay-0042"
	args := []string{
		"-registry", reg.Addr, "-nats", natsURL, "-database", dbURL,
		"-stream", stream, "-subject", subject, "-durable", "ledger", "-mode", mode,
		"-workers", "2", "-batch", "8", "-lease", "1s", "-ack-wait", "1s",
		"-slow", "5ms", "-stall-after-write", stalled,
	}
	replicas := map[string]*replica{
		"replica-a": startReplica(t, bin, "replica-a", args...),
		"replica-b": startReplica(t, bin, "replica-b", args...),
	}

	// The payments, published with duplicates: every third one twice in a
	// row, every fifth one again at the end; one invalid payment twice, one
	// undecodable message, and one payment id reused with another amount.
	const n = 120
	want := map[string]Payment{}
	balances := map[string]int64{}
	var payments []Payment
	for i := range n {
		p := Payment{ID: fmt.Sprintf("pay-%04d", i), Account: fmt.Sprintf("acct-%d", i%7), AmountMinor: int64(100 + i)}
		payments = append(payments, p)
		want[p.ID] = p
		balances[p.Account] += p.AmountMinor
	}
	publish := func(v any) {
		data, err := json.Marshal(v)
		require.NoError(t, err)
		_, err = js.Publish(ctx, subject, data)
		require.NoError(t, err)
	}
	invalid := Payment{ID: "pay-invalid", Account: "acct-0", AmountMinor: 0}
	publish(invalid)
	for i, p := range payments {
		publish(p)
		if i%3 == 0 {
			publish(p)
		}
	}
	_, err = js.Publish(ctx, subject, []byte("not json"))
	require.NoError(t, err)
	publish(invalid)
	for i, p := range payments {
		if i%5 == 0 {
			publish(p)
		}
	}
	publish(Payment{ID: "pay-0007", Account: "acct-0", AmountMinor: 999_999})

	db, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close(context.Background()) })
	count := func() int {
		var c int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&c); err != nil {
			return -1 // the first replica has not created the table yet
		}
		return c
	}

	// Wait for the stalled write, then kill the replica that made it.
	var victim string
	var firstToken int64
	waitFor(t, "the stalled ledger write of "+stalled, func() bool {
		err := db.QueryRow(ctx, `SELECT writer, token FROM ledger_entries WHERE payment_id = $1`, stalled).Scan(&victim, &firstToken)
		return err == nil
	})
	atKill := count()
	replicas[victim].kill(t)
	t.Logf("killed %s after its write of %s; %d of %d payments in the ledger", victim, stalled, atKill, n)
	replicas["replica-c"] = startReplica(t, bin, "replica-c", args...)

	cons, err := js.Consumer(ctx, stream, "ledger")
	require.NoError(t, err)
	waitFor(t, "every message acknowledged and every payment applied", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && count() == n
	})
	for name, r := range replicas {
		if name != victim {
			r.stop(t)
		}
	}

	// Exactly the payments, each once, with its amount: no double, no gap.
	rows, err := db.Query(ctx, `SELECT payment_id, account, amount_minor, token, attempt, writer FROM ledger_entries`)
	require.NoError(t, err)
	type entry struct {
		p              Payment
		token, attempt int64
		writer         string
	}
	got := map[string]entry{}
	for rows.Next() {
		var e entry
		require.NoError(t, rows.Scan(&e.p.ID, &e.p.Account, &e.p.AmountMinor, &e.token, &e.attempt, &e.writer))
		got[e.p.ID] = e
	}
	require.NoError(t, rows.Err())
	require.Len(t, got, n)
	for id, p := range want {
		require.Equal(t, p, got[id].p, "entry of %s", id)
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
	require.Equal(t, balances, gotBalances)

	// The crashed write was taken over and replaced, not added to.
	s := got[stalled]
	require.Greater(t, s.attempt, int64(1), "the stalled payment was applied again after a takeover")
	require.Greater(t, s.token, firstToken)
	require.NotEqual(t, victim, s.writer)

	// Every entry was written under the token its fence row holds: no
	// entry landed past the fence.
	var fenced, mismatched int
	require.NoError(t, db.QueryRow(ctx, `
		SELECT count(*), count(*) FILTER (WHERE f.token <> e.token)
		FROM ledger_fence f JOIN ledger_entries e ON e.payment_id = f.key
		WHERE f.consumer = $1`, consumer).Scan(&fenced, &mismatched))
	require.Equal(t, n, fenced)
	require.Zero(t, mismatched)

	// The registry holds every outcome, the refusal included.
	for _, p := range payments {
		rec, err := reg.Client.Lookup(ctx, client.Key{Consumer: consumer, Kind: client.KindMessage, Key: p.ID})
		require.NoError(t, err)
		require.Equal(t, client.StateCompleted, rec.State, p.ID)
	}
	rec, err := reg.Client.Lookup(ctx, client.Key{Consumer: consumer, Kind: client.KindMessage, Key: invalid.ID})
	require.NoError(t, err)
	require.NotNil(t, rec.Result.Failure, "the invalid payment's refusal is stored and replayed")
	require.Contains(t, rec.Result.Failure.Message(), "amount_minor must be positive")
	require.False(t, errors.Is(rec.Result.Err(), nil))
}
