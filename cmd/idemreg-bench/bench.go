package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/cmd/idemreg-bench/internal/bench"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/postgres"
)

// benchConfig is what idemreg-bench reads from its flags.
type benchConfig struct {
	Targets     []benchTarget
	Callers     []int
	Duration    time.Duration
	Count       int
	Warmup      time.Duration
	Repeat      int
	Mix         bench.Mix
	Addr        string
	ServerPID   int
	DatabaseURL string
	RedisAddr   string
	Preload     int
	ServerFlags []string
	ProfileDir  string
	Chart       string
	JSON        string
	ResultBytes int
	Label       string
	Replot      string
	// ClientInFlight is the Go client's Batching.MaxInFlight values (0:
	// its default); a target through the client runs once for each.
	ClientInFlight []int
	// Batch is the keys per call of the -batch targets.
	Batch int
	// ServerBinary is the idemreg binary started for a server target
	// without an [@binary] of its own; builtServer is the one built from
	// this module when it is empty (a temporary file, so not in the JSON).
	ServerBinary string
	builtServer  string
	// Waiters is the samples of each waiter-latency measurement (0: none);
	// WaiterPairs, the holder/waiter pairs at a time.
	Waiters, WaiterPairs int
	WaiterSettle         time.Duration
	// WaiterRecheck is the spawned servers' --wait-recheck in the waiter
	// measurement: long, so that only being told explains a fast wake
	// across replicas.
	WaiterRecheck time.Duration
}

const benchUsage = `idemreg-bench drives the registry and hand-written baselines with the same
load, back to back, and prints throughput and latency.

Targets (they take turns, run after run, so that other load falls on all alike):
  idemreg           a server on --database-url, started for each run (or --addr)
  idemreg-embedded  a server on a fresh embedded store, started for each run
  sql               the hand-written inbox table on --database-url, with pgx
  redis             SET NX PX / SET XX on --redis-addr
  grpc-floor        a bare grpc-go server (no interceptors, no store), started
                    for each run, whose Claim and Complete are each one
                    health Check: what any gRPC hop costs on this machine.
                    It runs every iteration as a new key.
                    grpc-floor[--static-window=N] has the static HTTP/2
                    windows of idemreg[--static-window=N]; the bench dials
                    either with the same windows.
  idemreg-batch, idemreg-embedded-batch
                    the same servers driven in batches: each iteration is
                    one BatchClaim of --batch new keys and one BatchComplete
                    of those acquired (no replays or collisions); a pair is
                    still one key, so pairs/s compares with the others, and
                    latencies are of whole batch calls
  sql-batch         the sql baseline batched by hand, driven like the -batch
                    targets: one multi-row INSERT ... ON CONFLICT DO NOTHING
                    (and one SELECT of the keys it did not insert) per
                    batch claim, one multi-row UPDATE per batch complete
  idemreg-pipelined, idemreg-embedded-pipelined
                    the callers are the workers of one client.Consumer: each
                    Complete is held and rides in the Batch of the next
                    Claim (one RPC, one store transaction); a pair's latency
                    is its Claim's, the wait for durability is not in it
  sql-pipelined     the same merge by hand: the held Completes' multi-row
                    UPDATE and the next Claim's INSERT in one pgx batch (one
                    implicit transaction, one round trip)
  idemreg[--flag NAME=value @binary ...]
                    a started server with extra flags and environment, and
                    optionally another idemreg binary to start (an older
                    build, say, so that old and new take turns in one run)

A started server is "idemreg serve" from the target's @binary, else from
--server-binary, else from ./cmd/idemreg of this module, which the bench
builds with go build once per invocation (run it from the repository).

With --waiters N, after the runs: N waiting Claims per server target
(idemreg, idemreg-embedded, with their [flags]), each woken by its key's
Complete, and the time from the Complete's return to the waiter's answer;
through the same server, and for idemreg (on --database-url, started by the
bench) also through a second server on the same database.

Flags:
`

func benchCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseBench(args, stderr)
	if err != nil {
		return err
	}
	if cfg.Replot != "" {
		return replot(cfg)
	}
	if cfg.ProfileDir != "" {
		if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil {
			return err
		}
	}
	if needsServerBinary(cfg) {
		dir, err := os.MkdirTemp("", "idemreg-bench-server-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		cfg.builtServer = filepath.Join(dir, "idemreg")
		if err := buildServer(ctx, cfg.builtServer, stderr); err != nil {
			return err
		}
	}
	if cfg.Preload > 0 {
		fmt.Fprintf(stdout, "preloading %d records into %s ...\n", cfg.Preload, postgres.Redact(cfg.DatabaseURL))
		t0 := time.Now()
		inserted, total, err := bench.Preload(ctx, cfg.DatabaseURL, cfg.Preload)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "preloaded %d new records in %s; the table holds %d\n", inserted, time.Since(t0).Round(time.Millisecond), total)
	}
	printMachine(stdout, cfg)

	var (
		reports []benchReport
		series  []bench.Series
	)
	series = make([]bench.Series, len(cfg.Targets))
	for i, t := range cfg.Targets {
		series[i].Name = t.Label
	}
	// Targets take turns within each repetition, so that a change in
	// what else the machine runs falls on all of them alike.
	for _, callers := range cfg.Callers {
		runs := make([][]benchRun, len(cfg.Targets))
		for rep := range cfg.Repeat {
			for i, t := range cfg.Targets {
				run, err := benchOnce(ctx, cfg, t, callers, rep, stderr)
				if err != nil {
					return fmt.Errorf("%s with %d callers: %w", t.Label, callers, err)
				}
				runs[i] = append(runs[i], run)
			}
		}
		for i, t := range cfg.Targets {
			rep := summarizeRuns(t.Label, callers, runs[i])
			reports = append(reports, rep)
			printReport(stdout, rep)
			series[i].Points = append(series[i].Points, bench.Point{Callers: callers, P50: rep.Median.Pair.P50, P99: rep.Median.Pair.P99, PairsPS: rep.PairsPS.Median})
		}
	}
	printTable(stdout, cfg, reports)
	waiters, err := benchWaiters(ctx, cfg, stdout, stderr)
	if err != nil {
		return err
	}
	if cfg.JSON != "" {
		if err := writeJSON(cfg.JSON, cfg, reports, waiters); err != nil {
			return err
		}
	}
	if cfg.Chart != "" {
		if err := writeChart(cfg, series); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "chart written to", cfg.Chart)
	}
	return nil
}

func parseBench(args []string, stderr io.Writer) (benchConfig, error) {
	cfg := benchConfig{DatabaseURL: os.Getenv("IDEMREG_DATABASE_URL")}
	fs := flag.NewFlagSet("idemreg-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, benchUsage); fs.PrintDefaults() }
	var targets, callers, mix, serverFlags, inFlight string
	fs.StringVar(&targets, "targets", "idemreg,sql,redis", "comma-separated targets: idemreg, idemreg-embedded (through the Go client, with its defaults), their -unary (one generated-stub RPC per call), -batch and -pipelined variants, sql, sql-batch, sql-pipelined, redis, grpc-floor; a started server takes extra flags and environment in brackets, e.g. idemreg[--sql-batch-size=1 GOGC=100]")
	fs.StringVar(&callers, "callers", "1,8,64", "comma-separated numbers of concurrent callers")
	fs.DurationVar(&cfg.Duration, "duration", 10*time.Second, "measured time of each run")
	fs.IntVar(&cfg.Count, "count", 0, "measure this many iterations per run instead of --duration")
	fs.DurationVar(&cfg.Warmup, "warmup", 2*time.Second, "unmeasured load before each run")
	fs.IntVar(&cfg.Repeat, "repeat", 3, "runs of each target and caller count; the report gives the median and the spread")
	fs.StringVar(&mix, "mix", "replay=5,collide=5", "percent of claims of completed keys (replay) and of keys another caller holds (collide); the rest are new keys, each claimed and completed")
	fs.StringVar(&cfg.Addr, "addr", "", "drive the idemreg server at this address instead of starting one per run")
	fs.IntVar(&cfg.ServerPID, "server-pid", 0, "with --addr: the server's process id, to report its peak RSS")
	fs.StringVar(&cfg.DatabaseURL, "database-url", cfg.DatabaseURL, "PostgreSQL for the idemreg target's server and the sql baseline (migrated: idemreg migrate)")
	fs.StringVar(&cfg.RedisAddr, "redis-addr", "127.0.0.1:6379", "Redis for the redis baseline")
	fs.StringVar(&cfg.ServerBinary, "server-binary", "", "the idemreg binary to start for server targets without [@binary] (empty: go build ./cmd/idemreg of this module, once per invocation)")
	fs.IntVar(&cfg.Preload, "preload", 0, "before the runs, make sure --database-url holds this many completed records (replays then claim them at random)")
	fs.StringVar(&serverFlags, "server-flags", "", "extra flags for each started server, space-separated (e.g. --sql-batch-size=1)")
	fs.StringVar(&cfg.ProfileDir, "profile-dir", "", "write a CPU profile of each started server's measured phase here (the server runs with --pprof-listen), and of the callers' side (cpu-client-*)")
	fs.StringVar(&cfg.Chart, "chart", "", "write an SVG chart of latency and throughput against callers to this file")
	fs.StringVar(&cfg.JSON, "json", "", "write every run's figures as JSON to this file")
	fs.IntVar(&cfg.ResultBytes, "result-bytes", 64, "size of each stored result")
	fs.StringVar(&cfg.Label, "label", "", "a note for the chart's title")
	fs.StringVar(&cfg.Replot, "replot", "", "draw --chart from the figures a run wrote with --json, and run nothing")
	fs.IntVar(&cfg.Batch, "batch", 64, "keys per batch claim and batch complete of the -batch targets")
	fs.StringVar(&inFlight, "client-in-flight", "0", "comma-separated values of the Go client's Batching.MaxInFlight for the idemreg and idemreg-embedded targets (0: the client's default); with more than one, each such target runs once for each, labelled target{in-flight=N}, side by side")
	fs.IntVar(&cfg.Waiters, "waiters", 0, "after the runs, measure this many woken waiters per server target and replica case (0: none)")
	fs.IntVar(&cfg.WaiterPairs, "waiter-pairs", 8, "holder/waiter pairs at a time in the waiter measurement")
	fs.DurationVar(&cfg.WaiterRecheck, "waiter-recheck", 10*time.Second, "the spawned servers' --wait-recheck in the waiter measurement: long, so that a waiter across replicas woken fast was told by the replica that completed its key")
	fs.DurationVar(&cfg.WaiterSettle, "waiter-settle", 50*time.Millisecond, "how long a holder lets its waiter's Claim start waiting before it completes; a waiter that arrives later counts as woken at once")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if cfg.Replot != "" {
		return cfg, nil
	}
	var errs []error
	for _, f := range strings.Split(inFlight, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			errs = append(errs, fmt.Errorf("--client-in-flight: %q is not a number of RPCs", f))
			continue
		}
		cfg.ClientInFlight = append(cfg.ClientInFlight, n)
	}
	for _, label := range strings.Split(targets, ",") {
		t, err := parseTarget(label)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if (t.Kind == "sql" || (t.Kind == "idemreg" && cfg.Addr == "")) && cfg.DatabaseURL == "" {
			errs = append(errs, fmt.Errorf("target %s needs --database-url", label))
		}
		cfg.Targets = append(cfg.Targets, t.withInFlight(cfg.ClientInFlight)...)
	}
	for _, c := range strings.Split(callers, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(c))
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("--callers: %q is not a positive number", c))
			continue
		}
		cfg.Callers = append(cfg.Callers, n)
	}
	m, err := bench.ParseMix(mix)
	if err != nil {
		errs = append(errs, err)
	}
	cfg.Mix = m
	cfg.ServerFlags = strings.Fields(serverFlags)
	if cfg.Repeat < 1 {
		errs = append(errs, errors.New("--repeat must be at least 1"))
	}
	if cfg.Duration <= 0 && cfg.Count <= 0 {
		errs = append(errs, errors.New("--duration or --count must be positive"))
	}
	if cfg.Preload > 0 && cfg.DatabaseURL == "" {
		errs = append(errs, errors.New("--preload needs --database-url"))
	}
	if cfg.Batch < 1 || cfg.Batch > server.MaxBatchItems {
		errs = append(errs, fmt.Errorf("--batch must be 1 to %d", server.MaxBatchItems))
	}
	if cfg.Waiters < 0 || cfg.WaiterPairs < 1 {
		errs = append(errs, errors.New("--waiters must not be negative and --waiter-pairs must be positive"))
	}
	return cfg, errors.Join(errs...)
}

// benchTarget is one target of a run: its kind and, for a server the
// bench starts, extra flags, environment and another binary to start,
// written "idemreg[--sql-batch-size=1 GOGC=100 @/tmp/idemreg-old]"; the
// whole text is its label.
type benchTarget struct {
	Label, Kind  string
	ServerArgs   []string
	ServerEnv    []string
	ServerBinary string
	// Batch: a -batch target, which drives its server in batches.
	Batch bool `json:",omitempty"`
	// Unary: a -unary target, which calls its server through the
	// generated stub, one RPC per call, instead of the Go client.
	Unary bool `json:",omitempty"`
	// StaticWindow is the --static-window=N of ServerArgs: the bench
	// dials its server with the same static windows.
	StaticWindow int32 `json:",omitempty"`
	// ClientInFlight is the Go client's Batching.MaxInFlight (0: its
	// default), for a target through the client.
	ClientInFlight int `json:",omitempty"`
	// Pipelined: a -pipelined target, whose Completes ride with the next
	// Claim (issue 37).
	Pipelined bool `json:",omitempty"`
}

// throughClient says whether t's calls go through the Go client.
func (t benchTarget) throughClient() bool {
	return (t.Kind == "idemreg" || t.Kind == "idemreg-embedded") && !t.Batch && !t.Unary && !t.Pipelined
}

// withInFlight is t once for each of the client's in-flight caps when its
// calls go through the client and there are several, each labelled with
// its cap; else t alone, with the one cap.
func (t benchTarget) withInFlight(caps []int) []benchTarget {
	if !t.throughClient() || len(caps) == 0 {
		return []benchTarget{t}
	}
	if len(caps) == 1 {
		t.ClientInFlight = caps[0]
		return []benchTarget{t}
	}
	out := make([]benchTarget, 0, len(caps))
	for _, n := range caps {
		c := t
		c.ClientInFlight = n
		c.Label = fmt.Sprintf("%s{in-flight=%d}", t.Label, n)
		out = append(out, c)
	}
	return out
}

func parseTarget(s string) (benchTarget, error) {
	// Every target dials with the windows a service gets from
	// client.DialOptions, and its server fixes its own the same (serve's
	// default; the floor is told): --static-window=0 in brackets gives
	// grpc-go's dynamic windows back on both sides.
	t := benchTarget{Label: s, Kind: s, StaticWindow: client.StaticWindow}
	if i := strings.IndexByte(s, '['); i >= 0 {
		if !strings.HasSuffix(s, "]") {
			return t, fmt.Errorf("target %q: missing ]", s)
		}
		t.Kind = s[:i]
		for _, tok := range strings.Fields(s[i+1 : len(s)-1]) {
			switch {
			case strings.HasPrefix(tok, "-"):
				t.ServerArgs = append(t.ServerArgs, tok)
				if v, ok := strings.CutPrefix(strings.TrimLeft(tok, "-"), "static-window="); ok {
					n, err := strconv.ParseInt(v, 10, 32)
					if err != nil || n < 0 {
						return t, fmt.Errorf("target %q: --static-window=%s is not a number of bytes", s, v)
					}
					t.StaticWindow = int32(n)
				}
			case strings.HasPrefix(tok, "@") && len(tok) > 1:
				t.ServerBinary = tok[1:]
			case strings.Contains(tok, "="):
				t.ServerEnv = append(t.ServerEnv, tok)
			default:
				return t, fmt.Errorf("target %q: %q is neither a --flag, NAME=value nor @binary", s, tok)
			}
		}
	}
	if base, ok := strings.CutSuffix(t.Kind, "-batch"); ok {
		t.Kind, t.Batch = base, true
	}
	if base, ok := strings.CutSuffix(t.Kind, "-unary"); ok && !t.Batch {
		t.Kind, t.Unary = base, true
	}
	if base, ok := strings.CutSuffix(t.Kind, "-pipelined"); ok && !t.Batch && !t.Unary {
		t.Kind, t.Pipelined = base, true
	}
	if len(t.ServerArgs)+len(t.ServerEnv) > 0 || t.ServerBinary != "" {
		// The floor takes the static windows alone, so that it stays the
		// floor of a server that has them.
		floorWindow := t.Kind == "grpc-floor" && len(t.ServerArgs) == 1 && t.StaticWindow > 0 && len(t.ServerEnv) == 0 && t.ServerBinary == ""
		if t.Kind != "idemreg" && t.Kind != "idemreg-embedded" && !floorWindow {
			return t, fmt.Errorf("target %q: only a started server takes [flags] (grpc-floor: --static-window=N alone)", s)
		}
	}
	switch t.Kind {
	case "idemreg", "idemreg-embedded":
		return t, nil
	case "sql":
		if !t.Unary {
			return t, nil
		}
	case "redis", "grpc-floor":
		if !t.Batch && !t.Unary && !t.Pipelined {
			return t, nil
		}
	}
	return t, fmt.Errorf("unknown target %q", s)
}

func fileSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '-' || r == '.' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' {
			return r
		}
		return '_'
	}, s)
}
