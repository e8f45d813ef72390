package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

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
