//go:build linearizability || chaos

// The linearizability checks under faults: concurrent clients drive a real
// `idemreg serve` while the test kills it, crashes its PostgreSQL and
// degrades or cuts the network between them; the recorded history is
// checked against the registry's model (tests/lincheck).
// docs/testing.md says how to run them and what they found.
//
//	cd tests && go test -tags linearizability -run Linearizability -v ./faults \
//	    -args -lin.duration=60s -lin.out=/tmp/lincheck

package faults

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/tests/lincheck"
	"github.com/idemreg/idemreg/tests/pgcluster"
)

var (
	linDuration = flag.Duration("lin.duration", 20*time.Second, "how long the workload runs under faults, per test")
	linClients  = flag.Int("lin.clients", 8, "concurrent clients")
	linKeys     = flag.Int("lin.keys", 3, "keys the clients share at a time")
	linOut      = flag.String("lin.out", "", "directory for the HTML visualisation of a failing history (default: a temporary directory, kept)")
	linCheck    = flag.Duration("lin.check-timeout", 2*time.Minute, "time the checker may take; running out fails the run")
)

// harness is a workload against one `idemreg serve` at a fixed address,
// which the test may kill and restart.
type harness struct {
	t        *testing.T
	bin, dir string
	addr     string
	env      []string
	args     []string
	embedded bool
	// throughClient sends the workload's single Claims and Completes
	// through the Go client, which batches concurrent ones.
	throughClient bool
	proc          *servetest.Process
	conn          *grpc.ClientConn
	rec           *lincheck.Recorder
	work          *lincheck.Workload
	stop          context.CancelFunc
	done          chan struct{}

	mu     sync.Mutex
	report []string
	// problems are the data races and recovered panics the server logged.
	problems []string
}

func newHarness(t *testing.T, env []string, args ...string) *harness {
	return newHarnessThrough(t, false, env, args...)
}

func newHarnessThrough(t *testing.T, throughClient bool, env []string, args ...string) *harness {
	h := &harness{t: t, bin: servetest.Binary(t), dir: t.TempDir(), addr: servetest.FreeAddr(t), env: env, args: args, throughClient: throughClient}
	// Reconnect fast after a restart: the default backoff grows to 2 min.
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 300 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	h.conn = conn
	h.start()
	h.rec = lincheck.NewRecorder()
	h.work = lincheck.NewWorkload(conn, h.rec, lincheck.Config{Clients: *linClients, Keys: *linKeys, Seed: uint64(time.Now().UnixNano()),
		ThroughClient: h.throughClient})
	return h
}

// start starts `idemreg serve` on h.addr and waits until it serves.
func (h *harness) start() {
	h.proc = servetest.StartWith(h.t, servetest.Options{Bin: h.bin, Dir: h.dir, Env: h.env, Addr: h.addr,
		Args: append([]string{"--log-level", "warn"}, h.args...),
		Observe: func(text string, line map[string]any) {
			if strings.Contains(text, "DATA RACE") || line["msg"] == "panic recovered" {
				h.mu.Lock()
				h.problems = append(h.problems, text)
				h.mu.Unlock()
			}
		}})
	h.waitHealth(healthpb.HealthCheckResponse_SERVING, 60*time.Second)
}

// kill kills the server with SIGKILL and waits for it to exit. On the
// embedded store nothing the dead process held can take effect later: the
// history gets a barrier there. (A statement it sent to PostgreSQL may
// still commit after it died.)
func (h *harness) kill() {
	require.NoError(h.t, h.proc.Cmd.Process.Signal(syscall.SIGKILL))
	_ = h.proc.Cmd.Wait()
	if h.embedded {
		h.rec.Barrier()
	}
}

// run starts the workload in the background.
func (h *harness) run() {
	ctx, cancel := context.WithCancel(context.Background())
	h.stop, h.done = cancel, make(chan struct{})
	go func() { defer close(h.done); h.work.Run(ctx) }()
}

// finish stops the workload, looks up every acknowledged Complete, and
// checks the history.
func (h *harness) finish() {
	t := h.t
	h.stop()
	<-h.done
	h.waitHealth(healthpb.HealthCheckResponse_SERVING, 60*time.Second)
	for _, err := range h.work.Verify(t.Context()) {
		t.Error(err)
	}
	for _, u := range h.work.Unexpected() {
		t.Errorf("unexpected answer: %s", u)
	}
	history, st := h.rec.History()
	t.Logf("history: %s; %d acknowledged Completes verified", st, len(h.work.Acknowledged()))
	repeats, recovered := h.work.Repeats()
	t.Logf("%d Claims repeated with their request id after a lost answer, %d of them ACQUIRED", repeats, recovered)
	h.mu.Lock()
	for _, line := range h.report {
		t.Log(line)
	}
	for _, line := range h.problems {
		t.Errorf("idemreg serve: %s", line)
	}
	h.mu.Unlock()
	out := *linOut
	if out == "" {
		out = os.TempDir()
	}
	require.NoError(t, os.MkdirAll(out, 0o755))
	path := filepath.Join(out, fmt.Sprintf("%s-%d.html", strings.ReplaceAll(t.Name(), "/", "_"), time.Now().Unix()))
	began := time.Now()
	err := lincheck.Check(history, *linCheck, path)
	t.Logf("checked %d calls in %v", st.Calls, time.Since(began).Round(time.Millisecond))
	require.NoError(t, err)
}

func (h *harness) logf(format string, args ...any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.report = append(h.report, fmt.Sprintf(format, args...))
}

func (h *harness) health() (healthpb.HealthCheckResponse_ServingStatus, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	res, err := healthpb.NewHealthClient(h.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return res.GetStatus(), err
}

// waitHealth waits until health reports want and returns how long it took.
func (h *harness) waitHealth(want healthpb.HealthCheckResponse_ServingStatus, within time.Duration) time.Duration {
	h.t.Helper()
	began := time.Now()
	for {
		if st, err := h.health(); err == nil && st == want {
			return time.Since(began)
		}
		if time.Since(began) > within {
			h.t.Fatalf("health did not report %v within %v", want, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// probe makes a Claim on a key outside the history with the given deadline
// and returns its code and how long it took.
func (h *harness) probe(deadline time.Duration) (codes.Code, time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	_, err := idemregv1.NewRegistryServiceClient(h.conn).Claim(ctx, &idemregv1.ClaimRequest{
		Consumer: "lincheck.probe", Kind: idemregv1.Kind_KIND_MESSAGE, Key: fmt.Sprintf("probe-%d", began.UnixNano())})
	return status.Code(err), time.Since(began)
}

// waitProbeOK waits until a Claim succeeds and returns how long it took.
func (h *harness) waitProbeOK(within time.Duration) time.Duration {
	h.t.Helper()
	began := time.Now()
	for time.Since(began) < within {
		if code, _ := h.probe(time.Second); code == codes.OK {
			return time.Since(began)
		}
		time.Sleep(20 * time.Millisecond)
	}
	h.t.Fatalf("no Claim succeeded within %v", within)
	return 0
}

// outage checks what a client sees while the store is unreachable: health
// turns NOT_SERVING, and a Claim fails with UNAVAILABLE before its deadline
// instead of hanging.
func (h *harness) outage(name string) {
	t := h.t
	t.Helper()
	notServing := h.waitHealth(healthpb.HealthCheckResponse_NOT_SERVING, 15*time.Second)
	const deadline = 3 * time.Second
	code, took := h.probe(deadline)
	h.logf("%s: health NOT_SERVING after %v; a Claim with a %v deadline answered %v in %v",
		name, notServing.Round(time.Millisecond), deadline, code, took.Round(time.Millisecond))
	require.Equal(t, codes.Unavailable, code, "%s: a Claim during the outage", name)
	require.Less(t, took, deadline, "%s: the Claim must fail before its deadline", name)
}

// recovered measures how long the service takes to serve again by itself
// once the fault ended: until a Claim succeeds, and until health reports
// SERVING (its loop pings the store every 2 s).
func (h *harness) recovered(name string, since time.Time) {
	h.waitProbeOK(60 * time.Second)
	claimed := time.Since(since)
	h.waitHealth(healthpb.HealthCheckResponse_SERVING, 60*time.Second)
	h.logf("%s: recovered: a Claim succeeded %v and health reported SERVING %v after the fault ended",
		name, claimed.Round(time.Millisecond), time.Since(since).Round(time.Millisecond))
}

// phases splits the run's duration into n pauses between faults.
func phases(n int) time.Duration { return *linDuration / time.Duration(n) }

// TestLinearizabilityEmbeddedSIGKILL kills the server on the embedded store
// with SIGKILL again and again while clients run, restarting it each time.
func TestLinearizabilityEmbeddedSIGKILL(t *testing.T) {
	h := newHarness(t, nil, "--data-dir", "data")
	h.embedded = true
	h.run()
	const kills = 4
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

// TestLinearizabilityThroughClientSIGKILL is the embedded store's SIGKILL
// run with the workload's single Claims and Completes sent through the Go
// client, whose concurrent calls share Batch RPCs (one store transaction
// each).
func TestLinearizabilityThroughClientSIGKILL(t *testing.T) {
	h := newHarnessThrough(t, true, nil, "--data-dir", "data")
	h.embedded = true
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

// TestLinearizabilityPostgresFaults runs the server on a PostgreSQL cluster
// of its own behind an in-process toxiproxy, and in turn: kills the
// server, crashes and restarts PostgreSQL, adds latency, resets
// connections, black-holes them, and cuts the network.
func TestLinearizabilityPostgresFaults(t *testing.T) {
	pg := pgcluster.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	require.NoError(t, postgres.Migrate(ctx, pg.URL(pg.Addr(), "postgres")))

	proxies := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	proxy := toxiproxy.NewProxy(proxies, "postgres", "127.0.0.1:0", pg.Addr())
	require.NoError(t, proxy.Start())
	t.Cleanup(proxy.Stop)
	toxic := func(name, typ, stream string, attrs string) {
		_, err := proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
			`{"name":%q,"type":%q,"stream":%q,"attributes":%s}`, name, typ, stream, attrs)))
		require.NoError(t, err)
	}
	untoxic := func(name string) { require.NoError(t, proxy.Toxics.RemoveToxic(context.Background(), name)) }

	h := newHarness(t, []string{"IDEMREG_DATABASE_URL=" + pg.URL(proxy.Listen, "postgres")})
	h.run()
	const faults = 6
	pause := phases(faults + 1)
	settle := func() { time.Sleep(pause) }
	// Faults run one after the other on the same history; a failing check
	// stops the test.
	step := func(name string, fault func()) { fault() }
	outageFor := max(pause/2, 4*time.Second)

	settle()
	step("SIGKILL serve", func() {
		h.kill()
		began := time.Now()
		h.start()
		h.recovered("SIGKILL serve", began)
	})

	settle()
	step("PostgreSQL stopped immediately", func() {
		require.NoError(t, pg.StopImmediate())
		h.outage("PostgreSQL down")
		time.Sleep(outageFor)
		began := time.Now()
		require.NoError(t, pg.Start())
		h.logf("PostgreSQL down: restarted with recovery in %v", time.Since(began).Round(time.Millisecond))
		h.recovered("PostgreSQL down", began)
	})

	settle()
	step("latency", func() {
		toxic("latency-down", "latency", "downstream", `{"latency":150,"jitter":100}`)
		toxic("latency-up", "latency", "upstream", `{"latency":50,"jitter":50}`)
		time.Sleep(outageFor)
		untoxic("latency-down")
		untoxic("latency-up")
		h.recovered("latency", time.Now())
	})

	settle()
	step("connections reset", func() {
		toxic("reset", "reset_peer", "upstream", `{"timeout":0}`)
		time.Sleep(outageFor)
		untoxic("reset")
		began := time.Now()
		h.recovered("connections reset", began)
	})

	settle()
	step("network black hole", func() {
		toxic("blackhole", "timeout", "upstream", `{"timeout":0}`)
		h.outage("black hole")
		time.Sleep(outageFor)
		untoxic("blackhole")
		h.recovered("black hole", time.Now())
	})

	settle()
	step("network cut", func() {
		proxy.Stop() // closes the listener and every connection
		h.outage("network cut")
		time.Sleep(outageFor)
		began := time.Now()
		require.NoError(t, proxy.Start())
		h.recovered("network cut", began)
	})

	settle()
	h.finish()
	if t.Failed() {
		t.Logf("PostgreSQL log:\n%s", pg.Log())
	}
}
