package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/idemreg/idemreg/client"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

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
	// ClientInFlight is the Go client's Batching.MaxInFlight (0: its
	// default).
	ClientInFlight int
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

func writeChart(cfg benchConfig, series []bench.Series) error {
	f, err := os.Create(cfg.Chart)
	if err != nil {
		return err
	}
	title := "idemreg vs hand-written baselines: " + cfg.Mix.String()
	if cfg.Label != "" {
		title += " (" + cfg.Label + ")"
	}
	if err := bench.WriteChart(f, title, series); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// replot draws --chart from the figures a run wrote with --json.
func replot(cfg benchConfig) error {
	if cfg.Chart == "" {
		return errors.New("--replot needs --chart")
	}
	b, err := os.ReadFile(cfg.Replot)
	if err != nil {
		return err
	}
	var saved struct {
		Config  struct{ Mix bench.Mix }
		Reports []benchReport
	}
	if err := json.Unmarshal(b, &saved); err != nil {
		return fmt.Errorf("%s: %w", cfg.Replot, err)
	}
	var series []bench.Series
	index := map[string]int{}
	for _, r := range saved.Reports {
		i, ok := index[r.Target]
		if !ok {
			i = len(series)
			index[r.Target] = i
			series = append(series, bench.Series{Name: r.Target})
		}
		series[i].Points = append(series[i].Points, bench.Point{
			Callers: r.Callers, P50: r.Median.Pair.P50, P99: r.Median.Pair.P99, PairsPS: r.PairsPS.Median,
		})
	}
	cfg.Mix = saved.Config.Mix
	return writeChart(cfg, series)
}

func parseBench(args []string, stderr io.Writer) (benchConfig, error) {
	cfg := benchConfig{DatabaseURL: os.Getenv("IDEMREG_DATABASE_URL")}
	fs := flag.NewFlagSet("idemreg-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, benchUsage); fs.PrintDefaults() }
	var targets, callers, mix, serverFlags string
	fs.StringVar(&targets, "targets", "idemreg,sql,redis", "comma-separated targets: idemreg, idemreg-embedded (through the Go client, with its defaults), their -unary (one generated-stub RPC per call) and -batch variants, sql, sql-batch, redis, grpc-floor; a started server takes extra flags and environment in brackets, e.g. idemreg[--sql-batch-size=1 GOGC=100]")
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
	fs.IntVar(&cfg.ClientInFlight, "client-in-flight", 0, "the Go client's Batching.MaxInFlight for the idemreg and idemreg-embedded targets (0: the client's default)")
	fs.IntVar(&cfg.Waiters, "waiters", 0, "after the runs, measure this many woken waiters per server target and replica case (0: none)")
	fs.IntVar(&cfg.WaiterPairs, "waiter-pairs", 8, "holder/waiter pairs at a time in the waiter measurement")
	fs.DurationVar(&cfg.WaiterSettle, "waiter-settle", 50*time.Millisecond, "how long a holder lets its waiter's Claim start waiting before it completes; a waiter that arrives later counts as woken at once")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if cfg.Replot != "" {
		return cfg, nil
	}
	var errs []error
	for _, label := range strings.Split(targets, ",") {
		t, err := parseTarget(label)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if (t.Kind == "sql" || (t.Kind == "idemreg" && cfg.Addr == "")) && cfg.DatabaseURL == "" {
			errs = append(errs, fmt.Errorf("target %s needs --database-url", label))
		}
		cfg.Targets = append(cfg.Targets, t)
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
}

func parseTarget(s string) (benchTarget, error) {
	t := benchTarget{Label: s, Kind: s}
	if i := strings.IndexByte(s, '['); i >= 0 {
		if !strings.HasSuffix(s, "]") {
			return t, fmt.Errorf("target %q: missing ]", s)
		}
		t.Kind = s[:i]
		for _, tok := range strings.Fields(s[i+1 : len(s)-1]) {
			switch {
			case strings.HasPrefix(tok, "-"):
				t.ServerArgs = append(t.ServerArgs, tok)
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
	if len(t.ServerArgs)+len(t.ServerEnv) > 0 || t.ServerBinary != "" {
		if t.Kind != "idemreg" && t.Kind != "idemreg-embedded" {
			return t, fmt.Errorf("target %q: only a started server takes [flags]", s)
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
		if !t.Batch && !t.Unary {
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

// benchRun is one run's figures.
type benchRun struct {
	bench.Result
	// DBCommits is the database's committed transactions during the run
	// (warmup included) per call, or -1 when not measured.
	CommitsPerCall float64
	// PeakRSS is the server's peak resident set in bytes, 0 when unknown.
	PeakRSS int64
	// ServerCPUPerCall and DBCPUPerCall are the CPU time the server process
	// and the database sessions of the target spent per measured call, in
	// microseconds, or -1 when not measured. On a shared machine they say
	// more than throughput does: they do not depend on who else runs.
	ServerCPUPerCall, DBCPUPerCall float64
	// ClientCPUPerCall is this process's CPU time per measured call: the
	// load generator and the target's client (gRPC, pgx or go-redis).
	ClientCPUPerCall float64
}

func benchOnce(ctx context.Context, cfg benchConfig, bt benchTarget, callers, rep int, stderr io.Writer) (benchRun, error) {
	run := benchRun{CommitsPerCall: -1, ServerCPUPerCall: -1, DBCPUPerCall: -1}
	target := bt.Kind
	runID := fmt.Sprintf("%s-%d-%d-%d", target, callers, rep, time.Now().UnixNano())
	// Round trips are counted as the database's commits, which its
	// statistics show once the sessions that made them have ended: so only
	// for the sessions this run opens and closes (a server started for it,
	// the sql baseline's pool).
	countsURL := ""
	if (target == "idemreg" && cfg.Addr == "") || target == "sql" {
		countsURL = cfg.DatabaseURL
	}
	var commits0 int64
	if countsURL != "" {
		var err error
		if commits0, err = bench.DBCommits(ctx, countsURL); err != nil {
			return run, err
		}
	}

	var (
		t   bench.Target
		srv *spawned
		pid int
		err error
	)
	switch target {
	case "grpc-floor":
		srv, err = spawnServer(ctx, cfg, bt, stderr)
		if err != nil {
			return run, err
		}
		defer srv.stop()
		pid = srv.cmd.Process.Pid
		t, err = bench.NewFloor(srv.addr)
	case "idemreg", "idemreg-embedded":
		addr := cfg.Addr
		pid = cfg.ServerPID
		if addr == "" {
			srv, err = spawnServer(ctx, cfg, bt, stderr)
			if err != nil {
				return run, err
			}
			defer srv.stop() // when returning early; stop is idempotent
			addr, pid = srv.addr, srv.cmd.Process.Pid
		}
		// Preloaded records belong to PreloadConsumer: replays claim them.
		if bt.Unary || bt.Batch {
			t, err = bench.NewRegistry(addr, bench.PreloadConsumer)
		} else {
			t, err = bench.NewRegistryClient(addr, bench.PreloadConsumer, client.Batching{MaxInFlight: cfg.ClientInFlight})
		}
	case "sql":
		t, err = bench.NewSQLInbox(ctx, cfg.DatabaseURL, "bench.sql", callers)
	case "redis":
		var r *bench.Redis
		r, err = bench.NewRedis(ctx, cfg.RedisAddr, "bench.redis."+runID, callers)
		if err == nil {
			defer func() { _ = r.Cleanup(context.WithoutCancel(ctx)) }()
		}
		t = r
	}
	if err != nil {
		return run, err
	}
	defer t.Close()

	bc := bench.Config{
		Callers: callers, Duration: cfg.Duration, Count: cfg.Count, Warmup: cfg.Warmup, Mix: cfg.Mix,
		KeyPrefix: runID + "-", Result: make([]byte, cfg.ResultBytes),
	}
	if target == "grpc-floor" {
		bc.Mix = bench.Mix{} // it knows no outcomes
	}
	if bt.Batch {
		bc.Batch, bc.Mix = cfg.Batch, bench.Mix{}
	}
	if cfg.Preload > 0 && target == "idemreg" {
		bc.ReplayKeys, bc.PreloadKey = cfg.Preload, bench.PreloadKey
	}
	var profileDone chan error
	if srv != nil && srv.pprof != "" && cfg.ProfileDir != "" {
		profileDone = make(chan error, 1)
	}
	dbApp := ""
	switch {
	case target == "sql":
		dbApp = bench.SQLApplicationName
	case target == "idemreg" && cfg.Addr == "":
		dbApp = "idemreg"
	}
	var serverCPU0, dbCPU0, clientCPU0 time.Duration
	var dbPIDs []int
	var clientProfile *os.File
	bc.OnMeasure = func() {
		if cfg.ProfileDir != "" {
			// The caller side too: the stub or the client package, and the
			// driver's own work, in this process.
			clientProfile = startClientProfile(cfg.ProfileDir, bt.Label, callers, rep, stderr)
		}
		if profileDone != nil {
			path := filepath.Join(cfg.ProfileDir, fmt.Sprintf("cpu-%s-%d-%d.pprof", fileSafe(bt.Label), callers, rep))
			go func() { profileDone <- fetchProfile(ctx, srv.pprof, cfg.Duration, path) }()
		}
		serverCPU0 = processCPU(pid)
		clientCPU0 = selfCPU()
		if dbApp != "" {
			dbPIDs, _ = bench.BackendPIDs(ctx, cfg.DatabaseURL, dbApp)
			for _, p := range dbPIDs {
				dbCPU0 += processCPU(p)
			}
		}
	}
	res, err := bench.Run(ctx, t, bc)
	if err != nil {
		return run, err
	}
	run.Result = res
	if clientProfile != nil {
		pprof.StopCPUProfile()
		_ = clientProfile.Close()
	}
	if res.Ops > 0 {
		run.ClientCPUPerCall = float64((selfCPU() - clientCPU0).Microseconds()) / float64(res.Ops)
	}
	if pid > 0 && res.Ops > 0 {
		run.ServerCPUPerCall = float64((processCPU(pid) - serverCPU0).Microseconds()) / float64(res.Ops)
	}
	if len(dbPIDs) > 0 && res.Ops > 0 {
		var dbCPU time.Duration
		for _, p := range dbPIDs {
			dbCPU += processCPU(p)
		}
		run.DBCPUPerCall = float64((dbCPU - dbCPU0).Microseconds()) / float64(res.Ops)
	}
	if profileDone != nil {
		if err := <-profileDone; err != nil {
			fmt.Fprintln(stderr, "bench: profile:", err)
		}
	}
	run.PeakRSS = peakRSS(pid)
	_ = t.Close()
	if srv != nil {
		srv.stop()
	}
	if countsURL != "" {
		// A session flushes its statistics as it exits, a moment after
		// its connection closed.
		time.Sleep(500 * time.Millisecond)
		commits1, err := bench.DBCommits(ctx, countsURL)
		if err != nil {
			return run, err
		}
		if res.TotalOps > 0 {
			run.CommitsPerCall = float64(commits1-commits0) / float64(res.TotalOps)
		}
	}
	return run, nil
}

// spawned is a server started for one run.
type spawned struct {
	cmd   *exec.Cmd
	addr  string
	pprof string
	dir   string
	done  chan error
	// stopped is set by stop, so a second stop does nothing.
	stopped bool
}

func benchFreeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func spawnServer(ctx context.Context, cfg benchConfig, bt benchTarget, stderr io.Writer) (*spawned, error) {
	target := bt.Kind
	exe := cmp.Or(bt.ServerBinary, cfg.ServerBinary, cfg.builtServer)
	if target == "grpc-floor" {
		// The floor's server is this binary's hidden command.
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	addr, err := benchFreeAddr()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idemreg-bench-")
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--listen", addr, "--log-level", "warn", "--log-format", "text"}
	switch target {
	case "idemreg":
		args = append(args, "--database-url", cfg.DatabaseURL)
	case "idemreg-embedded":
		args = append(args, "--database-url", "", "--data-dir", filepath.Join(dir, "data"))
	case "grpc-floor":
		args = []string{floorServerCommand, "--listen", addr}
	}
	s := &spawned{addr: addr, dir: dir, done: make(chan error, 1)}
	if cfg.ProfileDir != "" && target != "grpc-floor" {
		if s.pprof, err = benchFreeAddr(); err != nil {
			return nil, err
		}
		args = append(args, "--pprof-listen", s.pprof)
	}
	if target != "grpc-floor" {
		args = append(args, cfg.ServerFlags...)
		args = append(args, bt.ServerArgs...)
	}
	s.cmd = exec.CommandContext(ctx, exe, args...)
	s.cmd.Env = append(os.Environ(), bt.ServerEnv...)
	s.cmd.Stdout, s.cmd.Stderr = stderr, stderr
	if err := s.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	go func() { s.done <- s.cmd.Wait() }()
	if err := waitServing(ctx, addr, s.done); err != nil {
		s.stop()
		return nil, fmt.Errorf("server %s did not start: %w", strings.Join(args, " "), err)
	}
	return s, nil
}

func waitServing(ctx context.Context, addr string, exited <-chan error) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	h := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("exited: %v", err)
		default:
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		res, err := h.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("not SERVING after 30s")
}

func (s *spawned) stop() {
	if s.stopped {
		return
	}
	s.stopped = true
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	os.RemoveAll(s.dir)
}

// startClientProfile starts a CPU profile of this process, the callers'
// side of a run, into dir; nil when it cannot (another profile runs).
func startClientProfile(dir, label string, callers, rep int, stderr io.Writer) *os.File {
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("cpu-client-%s-%d-%d.pprof", fileSafe(label), callers, rep)))
	if err != nil {
		fmt.Fprintln(stderr, "bench: client profile:", err)
		return nil
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintln(stderr, "bench: client profile:", err)
		_ = f.Close()
		return nil
	}
	return f
}

// selfCPU is this process's user and system CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processCPU reads the user and system CPU time a process has used so far
// (/proc/PID/stat, in clock ticks of 10 ms), or 0.
func processCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The command name may hold spaces; the fields after it do not.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// peakRSS reads a process's peak resident set (VmHWM) in bytes.
func peakRSS(pid int) int64 {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

func fetchProfile(ctx context.Context, pprofAddr string, d time.Duration, path string) error {
	secs := max(int(d.Seconds()), 1)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", pprofAddr, secs), nil)
	if err != nil {
		return err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return fmt.Errorf("pprof: %s", res.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, res.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// spread is the median and range of one figure across repeated runs.
type spread struct{ Median, Min, Max float64 }

func spreadOf(v []float64) spread {
	s := slices.Clone(v)
	slices.Sort(s)
	return spread{Median: s[len(s)/2], Min: s[0], Max: s[len(s)-1]}
}

func (s spread) format(f string) string {
	if s.Min == s.Max {
		return fmt.Sprintf(f, s.Median)
	}
	return fmt.Sprintf(f+" ("+f+"–"+f+")", s.Median, s.Min, s.Max)
}

// benchReport is one target and caller count over its repeated runs.
type benchReport struct {
	Target  string
	Callers int
	Runs    []benchRun
	// Median is the run with the median throughput: its latencies are the
	// ones printed.
	Median   benchRun
	PairsPS  spread
	PairP99  spread // milliseconds
	ClaimP99 spread // milliseconds
}

func summarizeRuns(target string, callers int, runs []benchRun) benchReport {
	r := benchReport{Target: target, Callers: callers, Runs: runs}
	var tp, pairP99, claimP99 []float64
	for _, run := range runs {
		tp = append(tp, run.PairsPerSecond())
		pairP99 = append(pairP99, float64(run.Pair.P99)/float64(time.Millisecond))
		claimP99 = append(claimP99, float64(run.Claim.P99)/float64(time.Millisecond))
	}
	r.PairsPS, r.PairP99, r.ClaimP99 = spreadOf(tp), spreadOf(pairP99), spreadOf(claimP99)
	byTP := slices.Clone(runs)
	slices.SortFunc(byTP, func(a, b benchRun) int { return cmp.Compare(a.PairsPerSecond(), b.PairsPerSecond()) })
	r.Median = byTP[len(byTP)/2]
	return r
}

func printMachine(w io.Writer, cfg benchConfig) {
	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Fprintf(w, "machine: %s/%s, %d CPUs, %s; load average %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version(), load)
	if p50, p99, err := fsyncTime(os.TempDir()); err == nil {
		fmt.Fprintf(w, "fsync (8 KiB write + fdatasync in %s): p50 %d µs, p99 %d µs\n", os.TempDir(), p50.Microseconds(), p99.Microseconds())
	}
	fmt.Fprintf(w, "mix %s, %s measured after %s warmup, %d runs each\n", cfg.Mix, durationOrCount(cfg), cfg.Warmup, cfg.Repeat)
	for _, t := range cfg.Targets {
		if t.Batch {
			fmt.Fprintf(w, "-batch targets: %d new keys per batch claim and batch complete (BatchClaim and BatchComplete; sql-batch: multi-row statements), no replays or collisions; their latencies are of whole batch calls, their ops of keys\n", cfg.Batch)
			break
		}
	}
}

func durationOrCount(cfg benchConfig) string {
	if cfg.Count > 0 {
		return strconv.Itoa(cfg.Count) + " iterations"
	}
	return cfg.Duration.String()
}

func printReport(w io.Writer, r benchReport) {
	m := r.Median
	fmt.Fprintf(w, "%-16s callers=%-3d pairs/s=%s pair p99 ms=%s\n", r.Target, r.Callers, r.PairsPS.format("%.0f"), r.PairP99.format("%.1f"))
	if m.Batch > 0 {
		fmt.Fprintf(w, "    median run, per batch of %d: claim %s  complete %s  pair %s (ms p50/p95/p99/max)\n",
			m.Batch, m.Claim, m.Complete, m.Pair)
	} else {
		fmt.Fprintf(w, "    median run: claim %s  complete %s  pair %s  replay %s  collide %s (ms p50/p95/p99/max)\n",
			m.Claim, m.Complete, m.Pair, m.Replay, m.Collide)
	}
	extra := ""
	if m.CommitsPerCall >= 0 {
		extra += fmt.Sprintf("  db commits/call %.3f", m.CommitsPerCall)
	}
	if m.PeakRSS > 0 {
		extra += fmt.Sprintf("  server peak RSS %.0f MiB", float64(m.PeakRSS)/(1<<20))
	}
	extra += "  CPU µs/call client+server+db " + cpuColumns(m)
	fmt.Fprintf(w, "    ops/s %.0f  errors %d  unexpected %d%s\n", m.OpsPerSecond(), m.Errors, m.Unexpected, extra)
	if m.FirstError != "" {
		fmt.Fprintf(w, "    first error: %s\n", m.FirstError)
	}
}

func printTable(w io.Writer, cfg benchConfig, reports []benchReport) {
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "target\tcallers\tpairs/s median (min–max)\tpair p50 ms\tpair p99 ms median (min–max)\tclaim p99 ms\tcommits/call\tCPU µs/call client+server+db\tpeak RSS MiB\t")
	for _, r := range reports {
		cpc, rss := "-", "-"
		if r.Median.CommitsPerCall >= 0 {
			cpc = fmt.Sprintf("%.3f", r.Median.CommitsPerCall)
		}
		if r.Median.PeakRSS > 0 {
			rss = fmt.Sprintf("%.0f", float64(r.Median.PeakRSS)/(1<<20))
		}
		cpu := cpuColumns(r.Median)
		fmt.Fprintf(tw, "%s\t%d\t%s\t%.2f\t%s\t%.2f\t%s\t%s\t%s\t\n", r.Target, r.Callers, r.PairsPS.format("%.0f"),
			float64(r.Median.Pair.P50)/float64(time.Millisecond), r.PairP99.format("%.1f"),
			float64(r.Median.Claim.P99)/float64(time.Millisecond), cpc, cpu, rss)
	}
	tw.Flush()
	// Ratios of every idemreg target against every baseline, per callers;
	// against the floor, the server's CPU and the latency it adds.
	for _, r := range reports {
		if !strings.HasPrefix(r.Target, "idemreg") {
			continue
		}
		for _, b := range reports {
			if b.Callers != r.Callers || strings.HasPrefix(b.Target, "idemreg") {
				continue
			}
			if strings.HasPrefix(b.Target, "grpc-floor") {
				fmt.Fprintf(w, "floor %s/%s at %d callers: server CPU per call %.2f×, pair p50 %.2f ms over the floor's %.2f ms\n",
					r.Target, b.Target, r.Callers, r.Median.ServerCPUPerCall/b.Median.ServerCPUPerCall,
					float64(r.Median.Pair.P50-b.Median.Pair.P50)/float64(time.Millisecond), float64(b.Median.Pair.P50)/float64(time.Millisecond))
				continue
			}
			if r.Median.Batch > 0 {
				// Its latencies are of whole batches: only throughput compares.
				fmt.Fprintf(w, "ratio %s/%s at %d callers: throughput %.2f× (batches of %d)\n", r.Target, b.Target, r.Callers,
					r.PairsPS.Median/b.PairsPS.Median, r.Median.Batch)
				continue
			}
			fmt.Fprintf(w, "ratio %s/%s at %d callers: throughput %.2f×, pair p50 %.2f×, pair p99 %.2f×\n", r.Target, b.Target, r.Callers,
				r.PairsPS.Median/b.PairsPS.Median, float64(r.Median.Pair.P50)/float64(b.Median.Pair.P50), r.PairP99.Median/b.PairP99.Median)
		}
	}
}

// floorServerCommand is the hidden first argument that runs the
// grpc-floor target's server instead of the bench.
const floorServerCommand = "floor-server"

// floorServer serves grpc.health.v1 alone, on a grpc-go server with no
// options, until ctx ends.
func floorServer(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("idemreg-bench "+floorServerCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:0", "address to listen on")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, grpchealth.NewServer())
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	return srv.Serve(ln)
}

// fsyncTime measures what a durable commit costs the machine at least:
// the median and 99th percentile of writing 8 KiB and fdatasync-ing it,
// in dir, 200 times.
func fsyncTime(dir string) (p50, p99 time.Duration, err error) {
	f, err := os.CreateTemp(dir, "idemreg-bench-fsync-")
	if err != nil {
		return 0, 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	buf := make([]byte, 8<<10)
	times := make([]time.Duration, 200)
	for i := range times {
		t0 := time.Now()
		if _, err := f.WriteAt(buf, int64(i)*int64(len(buf))); err != nil {
			return 0, 0, err
		}
		if err := syscall.Fdatasync(int(f.Fd())); err != nil {
			return 0, 0, err
		}
		times[i] = time.Since(t0)
	}
	slices.Sort(times)
	return times[len(times)/2], times[len(times)*99/100], nil
}

// cpuColumns is "client+server+db=total" in µs per call, "-" for a part
// not measured (redis's server, say).
func cpuColumns(r benchRun) string {
	part := func(v float64) string {
		if v < 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f", v)
	}
	total := r.ClientCPUPerCall + max(r.ServerCPUPerCall, 0) + max(r.DBCPUPerCall, 0)
	return fmt.Sprintf("%s+%s+%s=%.0f", part(r.ClientCPUPerCall), part(r.ServerCPUPerCall), part(r.DBCPUPerCall), total)
}

func writeJSON(path string, cfg benchConfig, reports []benchReport, waiters []waiterReport) error {
	cfg.DatabaseURL = postgres.Redact(cfg.DatabaseURL)
	b, err := json.MarshalIndent(struct {
		Config  benchConfig
		Reports []benchReport
		Waiters []waiterReport `json:",omitempty"`
	}{cfg, reports, waiters}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// waiterReport is one waiter-latency measurement.
type waiterReport struct {
	Target string
	// Replica is "same" (waiter and holder on one server) or "other" (two
	// servers on one database).
	Replica string
	bench.WaitResult
}

// benchWaiters measures woken waiters (--waiters) for each server target
// that is not a -batch one: through the server the holder completes on,
// and, for idemreg on --database-url, through a second server on the same
// database, which learns of the Complete only by its re-check.
func benchWaiters(ctx context.Context, cfg benchConfig, stdout, stderr io.Writer) ([]waiterReport, error) {
	if cfg.Waiters == 0 {
		return nil, nil
	}
	var out []waiterReport
	seen := map[string]bool{}
	for _, bt := range cfg.Targets {
		if bt.Batch || (bt.Kind != "idemreg" && bt.Kind != "idemreg-embedded") || seen[bt.Label] {
			continue
		}
		seen[bt.Label] = true
		cases := []string{"same"}
		if bt.Kind == "idemreg" && cfg.Addr == "" {
			cases = append(cases, "other")
		}
		for _, replica := range cases {
			r, err := waitersOnce(ctx, cfg, bt, replica, stderr)
			if err != nil {
				return nil, fmt.Errorf("waiters on %s, %s replica: %w", bt.Label, replica, err)
			}
			out = append(out, r)
			fmt.Fprintf(stdout, "waiters %-16s %s replica: %d woken, %d not woken, %d errors; Complete's return to the waiter's answer ms p50/p95/p99/max %s\n",
				r.Target, r.Replica, r.Woken, r.NotWoken, r.Errors, r.Wake)
			if r.FirstError != "" {
				fmt.Fprintf(stdout, "    first error: %s\n", r.FirstError)
			}
		}
	}
	if len(out) > 0 {
		fmt.Fprintf(stdout, "(a waiter through another replica notices the Complete by its re-check, every %s unless the server's --wait-recheck says otherwise)\n", server.DefaultWaitRecheck)
	}
	return out, nil
}

func waitersOnce(ctx context.Context, cfg benchConfig, bt benchTarget, replica string, stderr io.Writer) (waiterReport, error) {
	rep := waiterReport{Target: bt.Label, Replica: replica}
	addrs := []string{cfg.Addr}
	if cfg.Addr == "" {
		addrs = addrs[:0]
		n := 1
		if replica == "other" {
			n = 2
		}
		for range n {
			srv, err := spawnServer(ctx, cfg, bt, stderr)
			if err != nil {
				return rep, err
			}
			defer srv.stop()
			addrs = append(addrs, srv.addr)
		}
	}
	holder, err := bench.NewRegistry(addrs[0], "bench.waiters")
	if err != nil {
		return rep, err
	}
	defer holder.Close()
	waiter := holder
	if len(addrs) > 1 {
		if waiter, err = bench.NewRegistry(addrs[1], "bench.waiters"); err != nil {
			return rep, err
		}
		defer waiter.Close()
	}
	res, err := bench.WaitLatency(ctx, holder, waiter, bench.WaitConfig{
		Samples: cfg.Waiters, Pairs: cfg.WaiterPairs, Settle: cfg.WaiterSettle,
		KeyPrefix: fmt.Sprintf("waiter-%s-%d-", replica, time.Now().UnixNano()), Result: make([]byte, cfg.ResultBytes),
	})
	rep.WaitResult = res
	return rep, err
}
