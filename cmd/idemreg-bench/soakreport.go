package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// soakProbe reads the server's figures: from /proc, its pprof listener,
// and its store (the data directory, or the database).
type soakProbe struct {
	pid         int
	pprof       string
	dataDir     string
	databaseURL string
	conn        *pgx.Conn
	// vacuum: VACUUM the registry's tables before each sample, standing
	// in for an autovacuum the database has turned off.
	vacuum bool
}

// autovacuumOff says whether the database at url has autovacuum off, in
// which case nothing reclaims the space of the rows the sweeper deletes.
func autovacuumOff(ctx context.Context, url string) (bool, error) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return false, err
	}
	defer c.Close(ctx)
	var v string
	if err := c.QueryRow(ctx, "SHOW autovacuum").Scan(&v); err != nil {
		return false, err
	}
	return v == "off", nil
}

func (p *soakProbe) close() {
	if p.conn != nil {
		_ = p.conn.Close(context.Background())
	}
}

// soakSample is one sampling window's figures. A figure the probe could
// not read is -1, and ProbeErrors says why.
type soakSample struct {
	ElapsedS, WindowS float64
	RSSBytes          int64
	Goroutines, FDs   int
	// StoreBytes is the data directory's size (embedded) or the
	// idemreg_* tables' with their indexes and TOAST (PostgreSQL);
	// Records their live records (PostgreSQL only, else -1).
	StoreBytes, Records int64
	// StoreDiskBytes is the data directory's blocks on disk (embedded,
	// else -1): more than its size while pebble's WAL files are
	// preallocated.
	StoreDiskBytes  int64
	Calls           int
	CallsPerS       float64
	Ops             map[string]int
	Errors          map[string]int `json:",omitempty"`
	Unexpected      int
	FirstUnexpected string `json:",omitempty"`
	Behind          int
	Expired         int
	WaitersWoken    int
	WaitersNotWoken int
	WaitsOutlasted  int
	P50Ms, P99Ms    float64
	// ServerCPU is the server's CPU time over the window, in cores; Load1
	// the machine's 1-minute load average at its end.
	ServerCPU, Load1 float64
	ProbeErrors      []string `json:",omitempty"`
	lat              []time.Duration
}

func (p *soakProbe) sample(ctx context.Context) (soakSample, error) {
	s := soakSample{Goroutines: -1, FDs: -1, StoreBytes: -1, Records: -1, StoreDiskBytes: -1}
	rss, err := procStatusBytes(p.pid, "VmRSS:")
	if err != nil {
		return s, fmt.Errorf("the server (pid %d) is gone: %w", p.pid, err)
	}
	s.RSSBytes = rss
	if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.pid)); err != nil {
		s.ProbeErrors = append(s.ProbeErrors, "fds: "+err.Error())
	} else {
		s.FDs = len(fds)
	}
	if n, err := p.goroutines(ctx); err != nil {
		s.ProbeErrors = append(s.ProbeErrors, "goroutines: "+err.Error())
	} else {
		s.Goroutines = n
	}
	if err := p.store(ctx, &s); err != nil {
		s.ProbeErrors = append(s.ProbeErrors, "store: "+err.Error())
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		s.Load1, _ = strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	}
	return s, nil
}

// procStatusBytes reads a "kB" field of /proc/PID/status in bytes.
func procStatusBytes(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// goroutines reads the count from the first line of the goroutine
// profile: "goroutine profile: total N".
func (p *soakProbe) goroutines(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.pprof+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return 0, err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	line, err := bufio.NewReader(res.Body).ReadString('\n')
	if err != nil {
		return 0, err
	}
	v, ok := strings.CutPrefix(strings.TrimSpace(line), "goroutine profile: total ")
	if !ok {
		return 0, fmt.Errorf("unexpected first line %q", line)
	}
	return strconv.Atoi(v)
}

func (p *soakProbe) store(ctx context.Context, s *soakSample) error {
	if p.dataDir != "" {
		var total, disk int64
		err := filepath.WalkDir(p.dataDir, func(_ string, d fs.DirEntry, err error) error {
			if err != nil {
				// A file compacted away between the listing and its stat.
				if os.IsNotExist(err) {
					return nil
				}
				return err
			}
			if info, err := d.Info(); err == nil && !d.IsDir() {
				total += info.Size()
				if st, ok := info.Sys().(*syscall.Stat_t); ok {
					disk += st.Blocks * 512
				}
			}
			return nil
		})
		if err == nil {
			s.StoreBytes, s.StoreDiskBytes = total, disk
		}
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if p.conn == nil {
		c, err := pgx.Connect(ctx, p.databaseURL)
		if err != nil {
			return err
		}
		p.conn = c
	}
	if p.vacuum {
		for _, t := range []string{"idemreg_records", "idemreg_members"} {
			if _, err := p.conn.Exec(ctx, "VACUUM "+t); err != nil {
				return fmt.Errorf("VACUUM %s: %w", t, err)
			}
		}
	}
	err := p.conn.QueryRow(ctx, `
SELECT (SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::BIGINT
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r' AND c.relname LIKE 'idemreg\_%' AND n.nspname = current_schema()),
       (SELECT count(*) FROM idemreg_records)`).Scan(&s.StoreBytes, &s.Records)
	if err != nil {
		_ = p.conn.Close(ctx)
		p.conn = nil
	}
	return err
}

// fill adds the load's window to s.
func (s *soakSample) fill(w *soakStats, elapsed, window time.Duration) {
	s.ElapsedS, s.WindowS = elapsed.Seconds(), window.Seconds()
	s.Calls, s.Ops, s.Errors, s.Unexpected, s.FirstUnexpected = w.Calls, w.Ops, w.Errors, w.Unexpected, w.FirstUnexpected
	s.Behind, s.Expired = w.Behind, w.Expired
	s.WaitersWoken, s.WaitersNotWoken, s.WaitsOutlasted = w.WaitersWoken, w.WaitersNotWoken, w.WaitsOutlasted
	s.CallsPerS = float64(w.Calls) / window.Seconds()
	s.lat = w.lat
	slices.Sort(s.lat)
	s.P50Ms, s.P99Ms = ms(quantile(s.lat, 0.50)), ms(quantile(s.lat, 0.99))
}

func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(q*float64(len(sorted))))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func printSoakHeader(w io.Writer) {
	fmt.Fprintf(w, "%8s %8s %6s %5s %10s %9s %8s %7s %7s %8s %8s %5s %5s  %s\n",
		"elapsed", "rss_MiB", "gorout", "fds", "store_MiB", "disk_MiB", "records", "calls", "calls/s", "p50_ms", "p99_ms", "cpu", "load1", "errors (unexpected codes), unexpected answers, behind, expired, waiters woken/not/outlasted")
}

func printSoakSample(w io.Writer, s soakSample) {
	records, disk := "-", "-"
	if s.Records >= 0 {
		records = strconv.FormatInt(s.Records, 10)
	}
	if s.StoreDiskBytes >= 0 {
		disk = strconv.FormatFloat(float64(s.StoreDiskBytes)/(1<<20), 'f', 2, 64)
	}
	errs := "none"
	if len(s.Errors) > 0 {
		var parts []string
		for code, n := range s.Errors {
			parts = append(parts, fmt.Sprintf("%s=%d", code, n))
		}
		slices.Sort(parts)
		errs = strings.Join(parts, ",")
	}
	fmt.Fprintf(w, "%8s %8.1f %6d %5d %10.2f %9s %8s %7d %7.1f %8.2f %8.2f %5.2f %5.2f  %s, %d, %d, %d, %d/%d/%d\n",
		(time.Duration(s.ElapsedS) * time.Second).String(), float64(s.RSSBytes)/(1<<20), s.Goroutines, s.FDs, float64(s.StoreBytes)/(1<<20), disk, records,
		s.Calls, s.CallsPerS, s.P50Ms, s.P99Ms, s.ServerCPU, s.Load1, errs, s.Unexpected, s.Behind, s.Expired, s.WaitersWoken, s.WaitersNotWoken, s.WaitsOutlasted)
	if s.FirstUnexpected != "" {
		fmt.Fprintf(w, "         first unexpected: %s\n", s.FirstUnexpected)
	}
	for _, e := range s.ProbeErrors {
		fmt.Fprintf(w, "         probe error: %s\n", e)
	}
}

// soakGrowth is one figure's trend: a least-squares line over the samples
// after the baseline (Start and End its values at the first and last of
// them, Change = (End-Start)/Start, PerHour its slope), and the means of
// the first and last baseline-long windows.
type soakGrowth struct {
	Figure                      string
	Points                      int
	Start, End, PerHour, Change float64
	FirstMean, LastMean         float64
}

// soakVerdict is one target's PASS or MISS.
type soakVerdict struct {
	Target string
	Pass   bool
	Detail string
}

type soakReport struct {
	Config  soakConfig
	Machine struct {
		GOOS, GOARCH, Go string
		CPUs             int
		LoadAtEnd        string
	}
	Samples []soakSample
	Growth  []soakGrowth
	// P99FirstMs and P99LastMs are the p99 of every measured call in the
	// first and the last baseline-long windows.
	P99FirstMs, P99LastMs float64
	Targets               []soakVerdict
	Missed                int
}

func soakSummarize(cfg soakConfig, samples []soakSample) soakReport {
	r := soakReport{Config: cfg, Samples: samples}
	r.Machine.GOOS, r.Machine.GOARCH, r.Machine.Go, r.Machine.CPUs = runtime.GOOS, runtime.GOARCH, runtime.Version(), runtime.NumCPU()
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		r.Machine.LoadAtEnd = strings.TrimSpace(string(b))
	}
	end := samples[len(samples)-1].ElapsedS
	base := cfg.Baseline.Seconds()
	inFirst := func(s soakSample) bool { return s.ElapsedS <= base || s.ElapsedS == samples[0].ElapsedS }
	inLast := func(s soakSample) bool { return s.ElapsedS > end-base || s.ElapsedS == end }
	figures := []struct {
		name string
		get  func(soakSample) float64
		flat bool
	}{
		{"rss_bytes", func(s soakSample) float64 { return float64(s.RSSBytes) }, true},
		{"goroutines", func(s soakSample) float64 { return float64(s.Goroutines) }, true},
		{"fds", func(s soakSample) float64 { return float64(s.FDs) }, true},
		{"store_bytes", func(s soakSample) float64 { return float64(s.StoreBytes) }, true},
		{"store_disk_bytes", func(s soakSample) float64 { return float64(s.StoreDiskBytes) }, false},
		{"records", func(s soakSample) float64 { return float64(s.Records) }, false},
		{"p99_ms", func(s soakSample) float64 { return s.P99Ms }, false},
	}
	for _, f := range figures {
		g := soakGrowth{Figure: f.name}
		var xs, ys, first, last []float64
		for _, s := range samples {
			v := f.get(s)
			if v < 0 {
				continue // not read
			}
			if s.ElapsedS > base {
				xs, ys = append(xs, s.ElapsedS/3600), append(ys, v)
			}
			if inFirst(s) {
				first = append(first, v)
			}
			if inLast(s) {
				last = append(last, v)
			}
		}
		if len(ys) == 0 && len(first) == 0 {
			continue // not measured on this store (records on the embedded one)
		}
		g.Points, g.FirstMean, g.LastMean = len(ys), mean(first), mean(last)
		if len(xs) >= 2 {
			slope, icept := fitLine(xs, ys)
			g.PerHour, g.Start, g.End = slope, icept+slope*xs[0], icept+slope*xs[len(xs)-1]
			if g.Start != 0 {
				g.Change = (g.End - g.Start) / math.Abs(g.Start)
			}
		}
		r.Growth = append(r.Growth, g)
		if !f.flat {
			continue
		}
		v := soakVerdict{Target: fmt.Sprintf("%s flat within %.0f%% after %s", f.name, cfg.Flat*100, cfg.Baseline)}
		if len(xs) < 2 {
			v.Detail = fmt.Sprintf("%d samples after the baseline: nothing to fit", len(xs))
		} else {
			v.Pass = math.Abs(g.Change) <= cfg.Flat
			v.Detail = fmt.Sprintf("fitted %.4g -> %.4g (%+.1f%%), %+.4g/h", g.Start, g.End, g.Change*100, g.PerHour)
		}
		r.Targets = append(r.Targets, v)
	}

	var firstLat, lastLat []time.Duration
	var calls int
	var secs float64
	var unexpected, behind, notWoken, expired int
	errs := map[string]int{}
	for _, s := range samples {
		if inFirst(s) {
			firstLat = append(firstLat, s.lat...)
		}
		if inLast(s) {
			lastLat = append(lastLat, s.lat...)
		}
		calls, secs = calls+s.Calls, secs+s.WindowS
		unexpected, behind, notWoken, expired = unexpected+s.Unexpected, behind+s.Behind, notWoken+s.WaitersNotWoken, expired+s.Expired
		for c, n := range s.Errors {
			errs[c] += n
		}
	}
	slices.Sort(firstLat)
	slices.Sort(lastLat)
	r.P99FirstMs, r.P99LastMs = ms(quantile(firstLat, 0.99)), ms(quantile(lastLat, 0.99))
	v := soakVerdict{Target: fmt.Sprintf("p99 of the last %s at most %.0f%% above the first %s's", cfg.Baseline, cfg.P99*100, cfg.Baseline)}
	if len(firstLat) == 0 || len(lastLat) == 0 {
		v.Detail = "no calls measured"
	} else {
		v.Pass = r.P99LastMs <= r.P99FirstMs*(1+cfg.P99)
		v.Detail = fmt.Sprintf("%.2f ms -> %.2f ms (%+.1f%%)", r.P99FirstMs, r.P99LastMs, (r.P99LastMs/r.P99FirstMs-1)*100)
	}
	r.Targets = append(r.Targets, v)
	rate := float64(calls) / secs
	r.Targets = append(r.Targets, soakVerdict{
		Target: fmt.Sprintf("load held: calls/s within 10%% of %.0f", cfg.Rate),
		Pass:   math.Abs(rate-cfg.Rate) <= 0.1*cfg.Rate,
		Detail: fmt.Sprintf("%.1f calls/s over %s, %d operations behind", rate, (time.Duration(secs) * time.Second).String(), behind),
	})
	r.Targets = append(r.Targets, soakVerdict{
		Target: "no unexpected errors or answers",
		Pass:   len(errs) == 0 && unexpected == 0 && notWoken == 0,
		Detail: fmt.Sprintf("errors by code %v, %d unexpected answers, %d waiters not woken, of %d calls (%d replays or collisions of keys past their retention not judged)", errs, unexpected, notWoken, calls, expired),
	})
	for _, v := range r.Targets {
		if !v.Pass {
			r.Missed++
		}
	}
	return r
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// fitLine is the least-squares line y = icept + slope*x.
func fitLine(xs, ys []float64) (slope, icept float64) {
	mx, my := mean(xs), mean(ys)
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx == 0 {
		return 0, my
	}
	slope = sxy / sxx
	return slope, my - slope*mx
}

func printSoakSummary(w io.Writer, r soakReport) {
	fmt.Fprintf(w, "\ngrowth (least-squares line over the samples after %s; means of the first and last %s):\n", r.Config.Baseline, r.Config.Baseline)
	fmt.Fprintf(w, "  %-12s %6s %14s %14s %14s %8s %14s %14s\n", "figure", "points", "fitted start", "fitted end", "per hour", "change", "first mean", "last mean")
	for _, g := range r.Growth {
		fmt.Fprintf(w, "  %-12s %6d %14.4g %14.4g %+14.4g %+7.1f%% %14.4g %14.4g\n", g.Figure, g.Points, g.Start, g.End, g.PerHour, g.Change*100, g.FirstMean, g.LastMean)
	}
	fmt.Fprintf(w, "p99 of every measured call: first %s %.2f ms, last %s %.2f ms\n", r.Config.Baseline, r.P99FirstMs, r.Config.Baseline, r.P99LastMs)
	fmt.Fprintln(w, "targets:")
	for _, v := range r.Targets {
		verdict := "MISS"
		if v.Pass {
			verdict = "PASS"
		}
		fmt.Fprintf(w, "  %s  %s: %s\n", verdict, v.Target, v.Detail)
	}
	fmt.Fprintf(w, "soak: %d of %d targets missed; load average at the end %s\n", r.Missed, len(r.Targets), r.Machine.LoadAtEnd)
}

func writeSoakJSON(cfg soakConfig, r soakReport) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(cfg.JSON, b, 0o644)
}
