package main

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg-bench/internal/bench"
	"github.com/idemreg/idemreg/storage/postgres"
)

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
