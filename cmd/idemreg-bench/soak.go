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

	"github.com/idemreg/idemreg/storage/postgres"
)

// The soak mode (issue 40, item 5): one started `idemreg serve` held at a
// steady mixed load for a long time, sampled every --soak-interval, to
// show whether its memory, goroutines, descriptors, store size and tail
// latency stay flat while retention turns the store over. The load is in
// soakload.go, the samples and the verdicts in soakreport.go.

// soakConfig is what the soak mode reads from its flags.
type soakConfig struct {
	Target benchTarget
	// Duration is the whole run; Interval the time between two samples;
	// Baseline the first part of the run, which the growth fit leaves out
	// (warm-up, the store filling up to its retention) and whose tail
	// latency the end of the run is compared with.
	Duration, Interval, Baseline time.Duration
	// Rate is the calls (RPCs, or a Consumer's Handle) a second the load
	// aims at.
	Rate float64
	// Retention is every Claim's; SweepInterval the server's in-process
	// sweeper's.
	Retention, SweepInterval time.Duration
	Workers                  int
	JSON                     string
	DatabaseURL              string `json:"-"`
	// Vacuum: when the database's autovacuum is off, VACUUM the
	// registry's tables before each sample instead (Vacuumed says whether
	// the run did).
	Vacuum, Vacuumed bool
	ServerBinary     string
	ServerFlags      []string
	// Flat is the most a figure may change over the fitted part of the run,
	// as a fraction of its fitted start; P99 the most the last window's p99
	// may exceed the first's, as a fraction.
	Flat, P99 float64
}

const soakUsage = `idemreg-bench --soak DURATION holds one started idemreg serve at a steady
mixed load (new keys, replays, fingerprint collisions, waiting Claims,
mixed Batches, a client.Consumer's pipelined Completes) at --soak-rate, with
a short retention and the in-process sweeper on, so that the store turns
over within the run. Every --soak-interval it prints the server's RSS,
goroutines, open descriptors, the store's size, the calls, errors by code
and p50/p99; at the end, each figure's growth per hour (a linear fit after
--soak-baseline) and a PASS or MISS per target. It exits non-zero when a
target is missed.

  go run ./cmd/idemreg-bench --soak 35m --soak-rate 150/s --targets idemreg-embedded
  go run ./cmd/idemreg-bench --soak 35m --soak-rate 150/s --targets idemreg --database-url URL

Flags:
`

// isSoak says whether args ask for the soak mode.
func isSoak(args []string) bool {
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "soak" {
			return true
		}
	}
	return false
}

func parseSoak(args []string, stderr io.Writer) (soakConfig, error) {
	cfg := soakConfig{DatabaseURL: os.Getenv("IDEMREG_DATABASE_URL")}
	fs := flag.NewFlagSet("idemreg-bench --soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, soakUsage); fs.PrintDefaults() }
	var target, rate, serverFlags string
	fs.DurationVar(&cfg.Duration, "soak", 0, "run the soak for this long")
	fs.StringVar(&rate, "soak-rate", "150/s", "calls a second the load aims at (N or N/s)")
	fs.DurationVar(&cfg.Interval, "soak-interval", time.Minute, "time between two samples (one printed line each)")
	fs.DurationVar(&cfg.Baseline, "soak-baseline", 10*time.Minute, "the first part of the run: left out of the growth fit, and the p99 the end is compared with")
	fs.DurationVar(&cfg.Retention, "soak-retention", time.Minute, "retention of every Claim (below serve's default --min-retention of 1m, the server is started with --min-retention set to it)")
	fs.DurationVar(&cfg.SweepInterval, "soak-sweep-interval", 10*time.Second, "the server's --sweep-interval")
	fs.IntVar(&cfg.Workers, "soak-workers", 64, "most operations in flight; an operation due while all are busy is counted as behind, not queued")
	fs.StringVar(&cfg.JSON, "soak-json", "", "write the samples, growth and verdicts as JSON to this file")
	fs.Float64Var(&cfg.Flat, "soak-flat", 0.10, "target: most RSS, goroutines, descriptors and store size may change over the fitted part of the run, as a fraction")
	fs.Float64Var(&cfg.P99, "soak-p99", 0.20, "target: most the last --soak-baseline's p99 may exceed the first's, as a fraction")
	fs.StringVar(&target, "targets", "idemreg-embedded", "the server: idemreg (on --database-url, migrated) or idemreg-embedded (a fresh data directory), with [flags] as in the bench")
	fs.StringVar(&cfg.DatabaseURL, "database-url", cfg.DatabaseURL, "PostgreSQL for the idemreg target (migrated: idemreg migrate)")
	fs.StringVar(&cfg.ServerBinary, "server-binary", "", "the idemreg binary to start (empty: go build ./cmd/idemreg of this module)")
	fs.StringVar(&serverFlags, "server-flags", "", "extra flags for the server, space-separated")
	fs.BoolVar(&cfg.Vacuum, "soak-vacuum", true, "idemreg target: when the database's autovacuum is off, VACUUM the registry's tables before each sample, as autovacuum's one-minute naptime would (else the sweeper's deletes leave dead rows whose space nothing reclaims)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	t, err := parseTarget(target)
	switch {
	case err != nil:
		errs = append(errs, err)
	case t.Kind != "idemreg" && t.Kind != "idemreg-embedded" || t.Batch || t.Unary || t.Pipelined:
		errs = append(errs, fmt.Errorf("--targets: the soak drives one server, idemreg or idemreg-embedded, not %q", target))
	case t.Kind == "idemreg" && cfg.DatabaseURL == "":
		errs = append(errs, errors.New("--targets idemreg needs --database-url"))
	}
	cfg.Target = t
	r, err := strconv.ParseFloat(strings.TrimSuffix(rate, "/s"), 64)
	if err != nil || r <= 0 {
		errs = append(errs, fmt.Errorf("--soak-rate: %q is not a positive number of calls a second", rate))
	}
	cfg.Rate = r
	if cfg.Duration <= 0 {
		errs = append(errs, errors.New("--soak must be a positive duration"))
	}
	if cfg.Interval <= 0 || cfg.Baseline < 0 || cfg.Retention <= 0 || cfg.SweepInterval <= 0 || cfg.Workers < 1 {
		errs = append(errs, errors.New("--soak-interval, --soak-retention, --soak-sweep-interval and --soak-workers must be positive, --soak-baseline not negative"))
	}
	if cfg.Duration > 0 && cfg.Baseline+2*cfg.Interval > cfg.Duration {
		errs = append(errs, fmt.Errorf("--soak %s leaves fewer than two samples after --soak-baseline %s at --soak-interval %s: nothing to fit", cfg.Duration, cfg.Baseline, cfg.Interval))
	}
	cfg.ServerFlags = strings.Fields(serverFlags)
	return cfg, errors.Join(errs...)
}

// errSoakMissed is returned when the run missed a target: it printed
// which, and wrote them to --soak-json.
var errSoakMissed = errors.New("soak: targets missed")

func soakCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseSoak(args, stderr)
	if err != nil {
		return err
	}
	bcfg := benchConfig{DatabaseURL: cfg.DatabaseURL, ServerBinary: cfg.ServerBinary, ServerFlags: cfg.ServerFlags, Targets: []benchTarget{cfg.Target}}
	if needsServerBinary(bcfg) {
		dir, err := os.MkdirTemp("", "idemreg-bench-server-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		bcfg.builtServer = filepath.Join(dir, "idemreg")
		if err := buildServer(ctx, bcfg.builtServer, stderr); err != nil {
			return err
		}
	}
	pprofAddr, err := benchFreeAddr()
	if err != nil {
		return err
	}
	bt := cfg.Target
	// --log-level error: every collision is a FAILED_PRECONDITION that
	// serve logs at warn, one line each.
	bt.ServerArgs = append([]string{"--pprof-listen", pprofAddr, "--sweep-interval", cfg.SweepInterval.String(), "--log-level", "error"}, bt.ServerArgs...)
	if cfg.Retention < time.Minute {
		bt.ServerArgs = append(bt.ServerArgs, "--min-retention", cfg.Retention.String())
	}
	srv, err := spawnServer(ctx, bcfg, bt, stderr)
	if err != nil {
		return err
	}
	defer srv.stop()
	probe := &soakProbe{pid: srv.cmd.Process.Pid, pprof: pprofAddr}
	if bt.Kind == "idemreg-embedded" {
		probe.dataDir = filepath.Join(srv.dir, "data")
	} else {
		probe.databaseURL = cfg.DatabaseURL
		off, err := autovacuumOff(ctx, cfg.DatabaseURL)
		if err != nil {
			return err
		}
		probe.vacuum = off && cfg.Vacuum
		cfg.Vacuumed = probe.vacuum
		switch {
		case probe.vacuum:
			fmt.Fprintln(stdout, "soak: the database has autovacuum off: the soak runs VACUUM idemreg_records, idemreg_members before each sample in its place")
		case off:
			fmt.Fprintln(stdout, "soak: the database has autovacuum off and --soak-vacuum=false: nothing reclaims the space of swept rows")
		}
	}
	defer probe.close()

	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Fprintf(stdout, "soak: %s for %s at %.0f calls/s, retention %s, sweep every %s, a sample every %s, fit after %s\n",
		bt.Label, cfg.Duration, cfg.Rate, cfg.Retention, cfg.SweepInterval, cfg.Interval, cfg.Baseline)
	fmt.Fprintf(stdout, "soak: server pid %d, args %s\n", probe.pid, postgres.Redact(strings.Join(srv.cmd.Args[1:], " ")))
	fmt.Fprintf(stdout, "soak: load mix per operation: %s; load average at the start %s", soakMixString(), load)

	gen, err := newSoakLoad(srv.addr, cfg)
	if err != nil {
		return err
	}
	samples, runErr := soakRun(ctx, cfg, gen, probe, stdout)
	gen.close()
	if len(samples) == 0 {
		return errors.Join(runErr, errors.New("soak: no samples taken"))
	}
	rep := soakSummarize(cfg, samples)
	printSoakSummary(stdout, rep)
	if cfg.JSON != "" {
		if err := writeSoakJSON(cfg, rep); err != nil {
			return errors.Join(runErr, err)
		}
	}
	if runErr != nil {
		return runErr
	}
	if rep.Missed > 0 {
		return fmt.Errorf("%w: %d of %d", errSoakMissed, rep.Missed, len(rep.Targets))
	}
	return nil
}

// soakRun drives gen for cfg.Duration and samples every cfg.Interval,
// printing each sample as it is taken. It stops early, with the samples
// so far, when ctx ends or the server is gone.
func soakRun(ctx context.Context, cfg soakConfig, gen *soakLoad, probe *soakProbe, stdout io.Writer) ([]soakSample, error) {
	start := time.Now()
	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); gen.drive(runCtx) }()
	defer func() { cancel(); <-loadDone }()

	printSoakHeader(stdout)
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	var (
		samples []soakSample
		cpu0    = processCPU(probe.pid)
		t0      = start
	)
	for {
		final := false
		select {
		case <-tick.C:
		case <-runCtx.Done():
			// The operations in flight finish (under their own timeouts)
			// and count in the last window.
			<-loadDone
			final = true
		}
		now := time.Now()
		w := gen.window()
		s, err := probe.sample(ctx)
		if err != nil {
			return samples, fmt.Errorf("soak: sampling at %s: %w", now.Sub(start).Round(time.Second), err)
		}
		cpu := processCPU(probe.pid)
		s.fill(w, now.Sub(start), now.Sub(t0))
		s.ServerCPU = float64(cpu-cpu0) / float64(now.Sub(t0))
		cpu0, t0 = cpu, now
		// The last window may be a sliver; it is kept only when it is at
		// least half an interval long.
		if !final || s.WindowS >= cfg.Interval.Seconds()/2 {
			samples = append(samples, s)
			printSoakSample(stdout, s)
		}
		if final {
			if ctx.Err() != nil {
				return samples, ctx.Err()
			}
			return samples, nil
		}
	}
}
