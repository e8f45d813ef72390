//go:build chaos

// The exactly-once effect under chaos: the examples' end-to-end scenario
// (examples/ledger: a NATS JetStream consumer applying payments to a
// PostgreSQL ledger through client.Once and a fenced write), run long, with
// duplicate messages, consumer crashes, registry crashes and database
// crashes, ending with an exact ledger. docs/testing.md has the figures.
//
//	cd tests && go test -tags chaos -run Chaos -v -timeout 30m ./faults \
//	    -args -chaos.messages=3000 -chaos.every=3s

package faults

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/tests/pgcluster"
)

var (
	chaosMessages  = flag.Int("chaos.messages", 600, "distinct payments to publish")
	chaosDuplicate = flag.Float64("chaos.duplicates", 0.2, "share of payments published twice")
	chaosEvery     = flag.Duration("chaos.every", 3*time.Second, "pause between faults")
	chaosReplicas  = flag.Int("chaos.replicas", 3, "consumer processes")
	chaosRate      = flag.Int("chaos.rate", 100, "messages published per second")
)

// payment is examples/ledger's message.
type payment struct {
	ID          string `json:"payment_id"`
	Account     string `json:"account"`
	AmountMinor int64  `json:"amount_minor"`
}

// consumerSlot runs one ledger replica and restarts it whenever it exits,
// killed by the test or failed on its own (it exits when its database is
// down at start).
type consumerSlot struct {
	name string
	mu   sync.Mutex
	cmd  *exec.Cmd
}

func (s *consumerSlot) kill() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil && s.cmd.Process.Signal(syscall.SIGKILL) == nil
}

func TestChaosLedgerExactlyOnce(t *testing.T) {
	natsURL := os.Getenv("IDEMREG_TEST_NATS_URL")
	if natsURL == "" {
		natsURL = nats.DefaultURL
	}
	nc, err := nats.Connect(natsURL, nats.Timeout(3*time.Second))
	require.NoError(t, err, "the chaos run needs NATS with JetStream (.ci/ensure-nats starts it)")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := t.Context()

	// One PostgreSQL cluster of the test's own holds the registry's and
	// the ledger's databases: a database crash hits both.
	pg := pgcluster.Start(t)
	admin, err := pgx.Connect(ctx, pg.URL(pg.Addr(), "postgres"))
	require.NoError(t, err)
	for _, db := range []string{"registry", "ledger"} {
		_, err := admin.Exec(ctx, "CREATE DATABASE "+db)
		require.NoError(t, err)
	}
	require.NoError(t, admin.Close(ctx))
	require.NoError(t, postgres.Migrate(ctx, pg.URL(pg.Addr(), "registry")))
	ledgerURL := pg.URL(pg.Addr(), "ledger")

	reg := newHarness(t, []string{"IDEMREG_DATABASE_URL=" + pg.URL(pg.Addr(), "registry")})

	bin := filepath.Join(t.TempDir(), "ledger")
	build := exec.Command("go", "build", "-o", bin, "./ledger")
	build.Dir = filepath.Join(servetest.RootDir(t), "examples") // a module of its own
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build examples/ledger: %s", out)

	suffix := hex.EncodeToString(fmt.Appendf(nil, "%d", time.Now().UnixNano()))[:12]
	stream, subject := "LEDGER_CHAOS_"+suffix, "ledger-chaos."+suffix+".payments"
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })

	var (
		applied, replayed, exits atomic.Int64
		stopping                 atomic.Bool
		wg                       sync.WaitGroup
	)
	args := []string{"-registry", reg.addr, "-nats", natsURL, "-database", ledgerURL,
		"-stream", stream, "-subject", subject, "-durable", "ledger",
		"-workers", "4", "-batch", "16", "-lease", "2s", "-ack-wait", "2s"}
	slots := make([]*consumerSlot, *chaosReplicas)
	for i := range slots {
		s := &consumerSlot{name: fmt.Sprintf("replica-%d", i)}
		slots[i] = s
		wg.Go(func() {
			for generation := 0; !stopping.Load(); generation++ {
				cmd := exec.Command(bin, append([]string{"-name", fmt.Sprintf("%s.%d", s.name, generation)}, args...)...)
				stderr, err := cmd.StderrPipe()
				if err != nil {
					t.Error(err)
					return
				}
				if err := cmd.Start(); err != nil {
					t.Error(err)
					return
				}
				s.mu.Lock()
				s.cmd = cmd
				s.mu.Unlock()
				sc := bufio.NewScanner(stderr)
				for sc.Scan() {
					line := sc.Text()
					if strings.Contains(line, `msg="payment done"`) {
						if strings.Contains(line, "applied=true") {
							applied.Add(1)
						}
						if strings.Contains(line, "replayed=true") {
							replayed.Add(1)
						}
					}
				}
				if err := cmd.Wait(); err != nil && !stopping.Load() {
					exits.Add(1)
				}
				s.mu.Lock()
				s.cmd = nil
				s.mu.Unlock()
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	t.Cleanup(func() {
		stopping.Store(true)
		for _, s := range slots {
			s.kill()
		}
		wg.Wait()
	})

	// Publish the payments at a steady rate, 20% of them twice (some
	// right away, some later), while the faults go on.
	want := map[string]payment{}
	balances := map[string]int64{}
	var published, duplicates int
	publishDone := make(chan error, 1)
	var payments []payment
	for i := range *chaosMessages {
		p := payment{ID: fmt.Sprintf("pay-%05d", i), Account: fmt.Sprintf("acct-%d", i%13), AmountMinor: int64(100 + i%997)}
		payments = append(payments, p)
		want[p.ID] = p
		balances[p.Account] += p.AmountMinor
	}
	rnd := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	var order, late []payment
	for _, p := range payments {
		order = append(order, p)
		if rnd.Float64() < *chaosDuplicate {
			duplicates++
			if rnd.IntN(2) == 0 {
				order = append(order, p) // at once, as a producer's retry
			} else {
				late = append(late, p) // later, as a replay
			}
		}
	}
	for _, p := range late {
		order = slices.Insert(order, len(order)/2+rnd.IntN(len(order)/2+1), p)
	}
	go func() {
		tick := time.NewTicker(time.Second / time.Duration(*chaosRate))
		defer tick.Stop()
		for _, p := range order {
			<-tick.C
			data, _ := json.Marshal(p)
			for {
				pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				_, err := js.Publish(pctx, subject, data)
				cancel()
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					publishDone <- err
					return
				}
			}
			published++
		}
		publishDone <- nil
	}()

	// The faults, one every chaos.every until the payments are all
	// published and a few more after.
	var kills, registryCrashes, databaseCrashes int
	began := time.Now()
	fault := func() {
		switch n := rnd.IntN(10); {
		case n < 5:
			if slots[rnd.IntN(len(slots))].kill() {
				kills++
			}
		case n < 8:
			reg.kill()
			reg.start()
			registryCrashes++
		default:
			require.NoError(t, pg.StopImmediate())
			time.Sleep(time.Duration(1000+rnd.IntN(2000)) * time.Millisecond)
			require.NoError(t, pg.Start())
			databaseCrashes++
		}
	}
	publishing := true
	after := 3
	for publishing || after > 0 {
		select {
		case err := <-publishDone:
			require.NoError(t, err)
			publishing = false
		case <-time.After(*chaosEvery):
			if !publishing {
				after--
			}
			fault()
		}
	}
	t.Logf("published %d messages (%d payments, %d duplicates) in %v", published, len(payments), duplicates, time.Since(began).Round(time.Second))

	// Wait until the consumer has nothing pending and the ledger is full.
	db, err := pgx.Connect(ctx, ledgerURL)
	require.NoError(t, err)
	defer db.Close(context.Background())
	cons, err := js.Consumer(ctx, stream, "ledger")
	require.NoError(t, err)
	settle := time.Now()
	for {
		var n int
		info, ierr := cons.Info(ctx)
		qerr := db.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&n)
		if ierr == nil && qerr == nil && info.NumPending == 0 && info.NumAckPending == 0 && n == len(payments) {
			break
		}
		if time.Since(settle) > 5*time.Minute {
			t.Fatalf("not settled after 5 minutes: %d of %d entries, consumer %+v (%v, %v)", n, len(payments), info, ierr, qerr)
		}
		time.Sleep(200 * time.Millisecond)
	}
	stopping.Store(true)
	for _, s := range slots {
		s.kill()
	}
	wg.Wait()

	// Exactly the payments, each once, with its amount; balances to the cent.
	rows, err := db.Query(ctx, `SELECT payment_id, account, amount_minor, attempt FROM ledger_entries`)
	require.NoError(t, err)
	got := map[string]payment{}
	rewritten := 0
	for rows.Next() {
		var p payment
		var attempt int64
		require.NoError(t, rows.Scan(&p.ID, &p.Account, &p.AmountMinor, &attempt))
		_, dup := got[p.ID]
		require.False(t, dup, "two entries for %s", p.ID)
		got[p.ID] = p
		if attempt > 1 {
			rewritten++
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, want, got, "the ledger holds every payment exactly once")
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
	require.Equal(t, balances, gotBalances, "balances")

	// And the registry holds every outcome.
	c := client.New(reg.conn)
	for _, p := range payments {
		rec, err := c.Lookup(ctx, client.Key{Consumer: "ledger.payments", Kind: client.KindMessage, Key: p.ID})
		require.NoError(t, err, p.ID)
		require.Equal(t, client.StateCompleted, rec.State, p.ID)
	}
	var total int64
	for _, b := range balances {
		total += b
	}
	t.Logf("ledger exact: %d payments once each, %d accounts, total %d minor units; the handler applied %d times "+
		"(%d entries rewritten by a takeover under a larger token), %d duplicates replayed from the registry",
		len(got), len(gotBalances), total, applied.Load(), rewritten, replayed.Load())
	reg.mu.Lock()
	for _, line := range reg.problems {
		t.Errorf("idemreg serve: %s", line)
	}
	reg.mu.Unlock()
	t.Logf("faults: %d consumer SIGKILLs, %d consumer exits on their own, %d registry SIGKILLs, %d database crashes (pg_ctl stop -m immediate)",
		kills, exits.Load()-int64(kills), registryCrashes, databaseCrashes)
}
