package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestBenchSmoke runs every target of idemreg-bench briefly against an
// in-process server and checks that it reports figures, a chart and JSON.
// It checks no figure: benchmarks measure, tests assert behaviour.
func TestBenchSmoke(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	store, err := postgres.Open(t.Context(), databaseURL)
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	srv, err := server.New(store, server.Config{})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-served) })

	targets := "idemreg,sql"
	rc := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	if err := rc.Ping(t.Context()).Err(); err != nil {
		t.Logf("redis target left out: no Redis on 127.0.0.1:6379 (%v)", err)
	} else {
		targets += ",redis"
	}
	rc.Close()

	dir := t.TempDir()
	chart, js := filepath.Join(dir, "chart.svg"), filepath.Join(dir, "bench.json")
	var out, errOut bytes.Buffer
	err = run(t.Context(), []string{
		"--targets", targets, "--addr", lis.Addr().String(), "--database-url", databaseURL,
		"--callers", "1,4", "--duration", "300ms", "--warmup", "0", "--repeat", "1",
		"--preload", "1000", "--mix", "replay=10,collide=10",
		"--chart", chart, "--json", js,
	}, &out, &errOut)
	require.NoError(t, err, "stderr: %s", errOut.String())
	t.Log(out.String())
	require.Contains(t, out.String(), "preloaded 1000 new records")
	require.Contains(t, out.String(), "ratio idemreg/sql at 4 callers")

	svg, err := os.ReadFile(chart)
	require.NoError(t, err)
	require.Contains(t, string(svg), "<svg")

	var report struct {
		Reports []struct {
			Target  string
			Callers int
			Median  struct {
				Pairs, Errors, Unexpected int
				CommitsPerCall            float64
			}
		}
	}
	b, err := os.ReadFile(js)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &report))
	require.NotEmpty(t, report.Reports)
	for _, r := range report.Reports {
		require.Positive(t, r.Median.Pairs, "%s/%d completed pairs", r.Target, r.Callers)
		require.Zero(t, r.Median.Errors, "%s/%d", r.Target, r.Callers)
		require.Zero(t, r.Median.Unexpected, "%s/%d", r.Target, r.Callers)
	}
	require.NotContains(t, string(b), "secret")

	replotted := filepath.Join(dir, "replot.svg")
	require.NoError(t, run(t.Context(), []string{"--replot", js, "--chart", replotted}, &out, &errOut))
	svg2, err := os.ReadFile(replotted)
	require.NoError(t, err)
	require.Equal(t, string(svg), string(svg2), "the chart drawn again from the JSON is the same")
}

func TestBenchFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"unknown target", []string{"--targets", "mysql"}},
		{"sql without database", []string{"--targets", "sql"}},
		{"bad callers", []string{"--targets", "redis", "--callers", "0"}},
		{"bad mix", []string{"--targets", "redis", "--mix", "replay=90,collide=20"}},
		{"batch too large", []string{"--targets", "idemreg-embedded-batch", "--batch", "501"}},
		{"negative waiters", []string{"--targets", "idemreg-embedded", "--waiters", "-1"}},
		{"bad in-flight cap", []string{"--targets", "idemreg-embedded", "--client-in-flight", "1,x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("IDEMREG_DATABASE_URL", "")
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			require.Error(t, run(ctx, tc.args, &out, &out))
		})
	}
}

func TestParseBenchTarget(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     benchTarget
		err      bool
	}{
		{name: "plain", in: "sql", want: benchTarget{Label: "sql", Kind: "sql"}},
		{name: "server flags and environment", in: "idemreg[--sql-batch-size=1 GOGC=100]", want: benchTarget{
			Label: "idemreg[--sql-batch-size=1 GOGC=100]", Kind: "idemreg",
			ServerArgs: []string{"--sql-batch-size=1"}, ServerEnv: []string{"GOGC=100"},
		}},
		{name: "another binary", in: "idemreg[@/tmp/idemreg-old --sql-batch-size=1]", want: benchTarget{
			Label: "idemreg[@/tmp/idemreg-old --sql-batch-size=1]", Kind: "idemreg",
			ServerArgs: []string{"--sql-batch-size=1"}, ServerBinary: "/tmp/idemreg-old",
		}},
		{name: "batch", in: "idemreg-embedded-batch", want: benchTarget{Label: "idemreg-embedded-batch", Kind: "idemreg-embedded", Batch: true}},
		{name: "batch with flags", in: "idemreg-batch[--sql-batch-size=1]", want: benchTarget{
			Label: "idemreg-batch[--sql-batch-size=1]", Kind: "idemreg", ServerArgs: []string{"--sql-batch-size=1"}, Batch: true,
		}},
		{name: "unary", in: "idemreg-unary", want: benchTarget{Label: "idemreg-unary", Kind: "idemreg", Unary: true}},
		{name: "embedded unary with flags", in: "idemreg-embedded-unary[GOGC=100]", want: benchTarget{
			Label: "idemreg-embedded-unary[GOGC=100]", Kind: "idemreg-embedded", ServerEnv: []string{"GOGC=100"}, Unary: true,
		}},
		{name: "static windows", in: "idemreg[--static-window=1048576]", want: benchTarget{
			Label: "idemreg[--static-window=1048576]", Kind: "idemreg", ServerArgs: []string{"--static-window=1048576"}, StaticWindow: 1 << 20,
		}},
		{name: "floor with static windows", in: "grpc-floor[--static-window=1048576]", want: benchTarget{
			Label: "grpc-floor[--static-window=1048576]", Kind: "grpc-floor", ServerArgs: []string{"--static-window=1048576"}, StaticWindow: 1 << 20,
		}},
		{name: "floor with other flags", in: "grpc-floor[--static-window=1048576 --x]", err: true},
		{name: "floor with environment", in: "grpc-floor[GOMAXPROCS=1]", err: true},
		{name: "static window not a number", in: "idemreg[--static-window=big]", err: true},
		{name: "unary baseline", in: "sql-unary", err: true},
		{name: "batched sql baseline", in: "sql-batch", want: benchTarget{Label: "sql-batch", Kind: "sql", Batch: true}},
		{name: "batch of a baseline without batches", in: "redis-batch", err: true},
		{name: "flags on a baseline", in: "sql[--x]", err: true},
		{name: "neither flag nor variable", in: "idemreg[junk]", err: true},
		{name: "unclosed", in: "idemreg[--x", err: true},
		{name: "unknown", in: "mysql", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseTarget(tc.in)
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			if tc.want.StaticWindow == 0 {
				// Every target has the client's fixed windows unless
				// its brackets say otherwise.
				tc.want.StaticWindow = client.StaticWindow
			}
			require.Equal(t, tc.want, got)
		})
	}
}

// TestBenchFloor runs the grpc-floor target from the built binary, which
// starts its own bare server for the run, and checks that calls went
// through it and nothing failed.
func TestBenchFloor(t *testing.T) {
	bin := benchBin(t)
	js := filepath.Join(t.TempDir(), "floor.json")
	out, err := exec.CommandContext(t.Context(), bin, "--targets", "grpc-floor",
		"--callers", "2", "--duration", "300ms", "--warmup", "0", "--repeat", "1", "--json", js).CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "fsync (8 KiB write + fdatasync")
	var report struct {
		Reports []struct {
			Target string
			Median struct {
				Pairs, Errors, Unexpected int
				ServerCPUPerCall          float64
			}
		}
	}
	b, err := os.ReadFile(js)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &report))
	require.Len(t, report.Reports, 1)
	r := report.Reports[0]
	require.Equal(t, "grpc-floor", r.Target)
	require.Positive(t, r.Median.Pairs)
	require.Zero(t, r.Median.Errors)
	require.Zero(t, r.Median.Unexpected)
	require.GreaterOrEqual(t, r.Median.ServerCPUPerCall, 0.0, "the started server's CPU is measured")
}

// TestBenchInFlightList runs a target through the client once for each
// --client-in-flight cap, side by side and labelled with it, against a
// server with static windows (dialled with them too), beside the floor
// with the same windows and a target the caps do not apply to.
func TestBenchInFlightList(t *testing.T) {
	// The floor's server is the bench's hidden command: a binary of its own.
	bench, bin := benchBin(t), idemregBin(t)
	js := filepath.Join(t.TempDir(), "inflight.json")
	out, err := exec.CommandContext(t.Context(), bench,
		"--targets", "idemreg-embedded[--static-window=1048576],idemreg-embedded-unary,grpc-floor[--static-window=1048576]",
		"--server-binary", bin, "--client-in-flight", "1,4",
		"--callers", "2", "--duration", "300ms", "--warmup", "0", "--repeat", "1", "--json", js).CombinedOutput()
	require.NoError(t, err, "%s", out)
	var report struct {
		Reports []struct {
			Target string
			Median struct{ Pairs, Errors, Unexpected int }
		}
	}
	b, err := os.ReadFile(js)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &report))
	var targets []string
	for _, r := range report.Reports {
		targets = append(targets, r.Target)
		require.Positive(t, r.Median.Pairs, r.Target)
		require.Zero(t, r.Median.Errors, r.Target)
		require.Zero(t, r.Median.Unexpected, r.Target)
	}
	require.Equal(t, []string{
		"idemreg-embedded[--static-window=1048576]{in-flight=1}", "idemreg-embedded[--static-window=1048576]{in-flight=4}",
		"idemreg-embedded-unary", "grpc-floor[--static-window=1048576]",
	}, targets)
}

// TestBenchOtherBinary starts the server of a target from the binary its
// label names: --server-binary is /dev/null, which does not run, so the
// run completes only if the named binary was started.
func TestBenchOtherBinary(t *testing.T) {
	bin := idemregBin(t)
	var out bytes.Buffer
	err := run(t.Context(), []string{"--targets", "idemreg-embedded[@" + bin + "]", "--server-binary", os.DevNull,
		"--callers", "2", "--duration", "300ms", "--warmup", "0", "--repeat", "1"}, &out, &out)
	require.NoError(t, err, "%s", out.String())
	require.Contains(t, out.String(), "idemreg-embedded[@"+bin+"]")
	require.Contains(t, out.String(), "errors 0  unexpected 0")
}

// TestBenchBatchAndWaiters runs the batch targets and the waiter
// measurement from the built binary, which starts the servers: on the
// embedded store, and on PostgreSQL with a second server on the same
// database for the other-replica waiters. It checks the shape of the
// report and that figures were measured, never what they are.
func TestBenchBatchAndWaiters(t *testing.T) {
	bin, server := benchBin(t), idemregBin(t)
	databaseURL := pgtest.NewDatabase(t)
	js := filepath.Join(t.TempDir(), "batch.json")
	out, err := exec.CommandContext(t.Context(), bin, "--server-binary", server,
		"--targets", "idemreg-batch,idemreg-embedded-batch,sql-batch,idemreg,idemreg-embedded", "--database-url", databaseURL,
		"--callers", "2", "--batch", "8", "--duration", "300ms", "--warmup", "0", "--repeat", "1",
		"--waiters", "10", "--waiter-pairs", "2", "--json", js).CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Logf("%s", out)
	require.Contains(t, string(out), "-batch targets: 8 new keys per batch claim and batch complete")
	require.Contains(t, string(out), "median run, per batch of 8:")
	require.Contains(t, string(out), "waiters idemreg          other replica:")

	var report struct {
		Reports []struct {
			Target string
			Median struct {
				Batch, Pairs, Ops, Errors, Unexpected int
				Pair                                  struct{ N int }
			}
		}
		Waiters []struct {
			Target, Replica         string
			Woken, NotWoken, Errors int
			Wake                    struct {
				N   int
				P99 time.Duration
			}
		}
	}
	b, err := os.ReadFile(js)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &report))
	require.Len(t, report.Reports, 5)
	for _, r := range report.Reports {
		m := r.Median
		require.Positive(t, m.Pairs, r.Target)
		require.Zero(t, m.Errors, r.Target)
		require.Zero(t, m.Unexpected, r.Target)
		if strings.HasSuffix(r.Target, "-batch") {
			require.Equal(t, 8, m.Batch, r.Target)
			require.Equal(t, 2*m.Pairs, m.Ops, "%s: a pair is one key claimed and completed", r.Target)
			require.Equal(t, m.Pairs, 8*m.Pair.N, "%s: one sample per batch of 8 pairs", r.Target)
		} else {
			require.Zero(t, m.Batch, r.Target)
		}
	}
	var cases []string
	for _, w := range report.Waiters {
		cases = append(cases, w.Target+"/"+w.Replica)
		require.Zero(t, w.Errors, "%s/%s", w.Target, w.Replica)
		require.Equal(t, 10, w.Woken+w.NotWoken, "%s/%s: every sample answered", w.Target, w.Replica)
		require.Positive(t, w.Woken, "%s/%s", w.Target, w.Replica)
		require.Equal(t, w.Woken, w.Wake.N, "%s/%s", w.Target, w.Replica)
	}
	require.Equal(t, []string{"idemreg/same", "idemreg/other", "idemreg-embedded/same"}, cases)
}

// TestBenchBuildsServer runs a server target with neither --server-binary
// nor [@binary]: the bench builds cmd/idemreg of this module and starts
// that.
func TestBenchBuildsServer(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run(t.Context(), []string{"--targets", "idemreg-embedded",
		"--callers", "1", "--duration", "200ms", "--warmup", "0", "--repeat", "1"}, &out, &errOut)
	require.NoError(t, err, "stderr: %s", errOut.String())
	require.Contains(t, errOut.String(), "building the server: go build -o ")
	require.Contains(t, out.String(), "errors 0  unexpected 0")
}

func TestHelpExitsZero(t *testing.T) {
	out, err := exec.CommandContext(t.Context(), benchBin(t), "-h").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "idemreg-bench drives the registry")
	require.Contains(t, string(out), "-server-binary")
}

// TestDynamicWindowsAsked: --static-window=0 gives grpc-go's dynamic
// windows back to a target, on its server and on the bench's dial.
func TestDynamicWindowsAsked(t *testing.T) {
	got, err := parseTarget("idemreg[--static-window=0]")
	require.NoError(t, err)
	require.Zero(t, got.StaticWindow)
}
