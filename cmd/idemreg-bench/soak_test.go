package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestSoak runs the soak mode briefly against a started serve on each
// store, with a retention of 4 s and the sweeper every second, and checks
// that every sample was read, every kind of operation ran and was
// answered as it expects (a replay of a live key COMPLETED, a collision
// FAILED_PRECONDITION, a waiter woken), and that the report and its JSON carry every
// target. The growth and p99 verdicts of 20 s on a shared machine mean
// nothing, so either is accepted; a run that missed a target returns
// errSoakMissed, never nil.
func TestSoak(t *testing.T) {
	serverBin := idemregBin(t)
	for _, store := range []string{"idemreg-embedded", "idemreg"} {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			js := filepath.Join(t.TempDir(), "soak.json")
			args := []string{"--soak", "20s", "--soak-rate", "40/s", "--soak-interval", "2s", "--soak-baseline", "4s",
				"--soak-retention", "4s", "--soak-sweep-interval", "1s", "--targets", store,
				"--server-binary", serverBin, "--soak-json", js}
			if store == "idemreg" {
				args = append(args, "--database-url", pgtest.NewDatabase(t))
			}
			var out, errOut bytes.Buffer
			runErr := run(t.Context(), args, &out, &errOut)
			t.Log(out.String())
			if runErr != nil {
				require.ErrorIs(t, runErr, errSoakMissed, "stderr: %s", errOut.String())
			}
			verdicts := strings.Count(out.String(), "\n  PASS  ") + strings.Count(out.String(), "\n  MISS  ")
			require.Equal(t, 7, verdicts, "a PASS or MISS line per target")

			var rep struct {
				Samples []soakSample
				Targets []soakVerdict
				Missed  int
			}
			b, err := os.ReadFile(js)
			require.NoError(t, err)
			require.NoError(t, json.Unmarshal(b, &rep))
			require.GreaterOrEqual(t, len(rep.Samples), 6)
			ops := map[string]int{}
			var created, woken int
			for _, s := range rep.Samples {
				require.Empty(t, s.ProbeErrors)
				require.Positive(t, s.RSSBytes)
				require.Positive(t, s.Goroutines)
				require.Positive(t, s.FDs)
				require.Positive(t, s.StoreBytes)
				for code, n := range s.Errors {
					// A call that did not end within its 30 s on an
					// overloaded machine is not the load's mistake; any
					// other code is.
					require.Equal(t, "DeadlineExceeded", code, "%d calls; first: %s", n, s.FirstUnexpected)
					t.Logf("%d calls timed out: %s", n, s.FirstUnexpected)
				}
				require.Zero(t, s.Unexpected, "first: %s", s.FirstUnexpected)
				require.Zero(t, s.WaitersNotWoken)
				require.Positive(t, s.Calls)
				for k, n := range s.Ops {
					ops[k] += n
				}
				woken += s.WaitersWoken
				created += s.Ops["new"] + s.Ops["wait"] + soakBatchKeys*s.Ops["batch"] + s.Ops["pipelined"]
			}
			for _, o := range soakOps {
				require.Positive(t, ops[o.name], "operations %q", o.name)
			}
			require.Positive(t, woken)
			if store == "idemreg" {
				// The sweeper turned the store over: it holds the last few
				// seconds' keys, not the run's.
				last := rep.Samples[len(rep.Samples)-1]
				require.Less(t, last.Records, int64(created)/2, "records left of %d created", created)
				require.Equal(t, int64(-1), last.StoreDiskBytes)
			} else {
				require.Equal(t, int64(-1), rep.Samples[0].Records)
				require.Positive(t, rep.Samples[0].StoreDiskBytes)
			}
			require.Len(t, rep.Targets, 7)
			missed := 0
			for _, v := range rep.Targets {
				require.NotEmpty(t, v.Detail, v.Target)
				if !v.Pass {
					missed++
				}
			}
			require.Equal(t, missed, rep.Missed)
			require.Equal(t, missed > 0, runErr != nil, "an error when, and only when, a target was missed")
		})
	}
}

// TestSoakSummarize checks the verdicts on made-up samples: flat figures
// pass, a figure that grows or a p99 that rises beyond its bound misses,
// and errors miss.
func TestSoakSummarize(t *testing.T) {
	cfg := soakConfig{Rate: 100, Baseline: 10 * time.Minute, Interval: time.Minute, Flat: 0.10, P99: 0.20}
	lat := func(d time.Duration) []time.Duration {
		v := make([]time.Duration, 100)
		for i := range v {
			v[i] = d
		}
		return v
	}
	samples := func(grow func(minute int) float64, p99 func(minute int) time.Duration) []soakSample {
		var out []soakSample
		for m := 1; m <= 30; m++ {
			out = append(out, soakSample{
				ElapsedS: float64(m * 60), WindowS: 60, Calls: 6000,
				RSSBytes: int64(50e6 * grow(m)), Goroutines: 150, FDs: 20, StoreBytes: 4e6, Records: 12000,
				lat: lat(p99(m)),
			})
		}
		return out
	}
	flat := func(int) float64 { return 1 }
	steady := func(int) time.Duration { return 2 * time.Millisecond }
	verdicts := func(r soakReport) map[string]bool {
		m := map[string]bool{}
		for _, v := range r.Targets {
			m[strings.Fields(v.Target)[0]] = v.Pass
		}
		return m
	}

	r := soakSummarize(cfg, samples(flat, steady))
	require.Zero(t, r.Missed, "%+v", r.Targets)
	require.Len(t, r.Targets, 7)

	// RSS up 1% a minute: 20% over the fitted 20 minutes.
	r = soakSummarize(cfg, samples(func(m int) float64 { return 1 + 0.01*float64(m) }, steady))
	require.Equal(t, map[string]bool{"rss_bytes": false, "goroutines": true, "fds": true, "store_bytes": true, "p99": true, "load": true, "no": true}, verdicts(r))
	require.InDelta(t, 0.6*50e6, r.Growth[0].PerHour, 1e3, "per hour")

	r = soakSummarize(cfg, samples(flat, func(m int) time.Duration {
		if m > 20 {
			return 3 * time.Millisecond
		}
		return 2 * time.Millisecond
	}))
	require.False(t, verdicts(r)["p99"])
	require.Equal(t, 2.0, r.P99FirstMs)
	require.Equal(t, 3.0, r.P99LastMs)

	s := samples(flat, steady)
	s[25].Errors = map[string]int{"Unavailable": 1}
	s[3].Calls = 3000
	r = soakSummarize(cfg, s)
	require.False(t, verdicts(r)["no"])
	require.True(t, verdicts(r)["load"], "3000 calls fewer of 180,000 is within 10%%")
	for i := range s {
		s[i].Calls = 5000
	}
	require.False(t, verdicts(soakSummarize(cfg, s))["load"])
}

func TestParseSoak(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no duration", []string{"--soak", "0s"}, "--soak must be a positive duration"},
		{"bad rate", []string{"--soak", "30m", "--soak-rate", "fast"}, `--soak-rate: "fast"`},
		{"nothing to fit", []string{"--soak", "11m"}, "fewer than two samples after --soak-baseline"},
		{"a baseline target", []string{"--soak", "30m", "--targets", "redis"}, "the soak drives one server"},
		{"a batch target", []string{"--soak", "30m", "--targets", "idemreg-batch"}, "the soak drives one server"},
		{"no database", []string{"--soak", "30m", "--targets", "idemreg", "--database-url", ""}, "needs --database-url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseSoak(tc.args, io.Discard)
			require.ErrorContains(t, err, tc.want)
		})
	}
	cfg, err := parseSoak([]string{"--soak=35m", "--soak-rate", "300/s", "--targets", "idemreg-embedded[GOGC=50]"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, 300.0, cfg.Rate)
	require.Equal(t, 35*time.Minute, cfg.Duration)
	require.Equal(t, []string{"GOGC=50"}, cfg.Target.ServerEnv)
	require.True(t, isSoak([]string{"--targets", "x", "-soak=1m"}))
	require.False(t, isSoak([]string{"--soak-rate", "1"}))
}
