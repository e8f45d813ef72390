package postgres_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// BenchmarkStatementCost runs Claims of new keys and their Completes
// through the store, one caller on one connection, alone (the single-row
// statements) and in explicit batches of 2, 4 and 8 (ClaimBatch and
// CompleteBatch: the batched statements). It prints what each key costs:
// the database backend's CPU (read from /proc, so the backend must run on
// this machine; without it the figure is absent), this process's CPU (the
// store's encoding and decoding, pgx), and the wall time. A batch of N
// costing about one single statement's price plus a small price per key is
// what docs/benchmarks.md ("Small batches") measures with it. It prints
// figures and asserts none.
//
//	go test -run '^$' -bench StatementCost -benchtime 2000x ./storage/postgres/
func BenchmarkStatementCost(b *testing.B) {
	url := pgtest.NewDatabase(b)
	preload(b, url, 100_000)
	s, err := postgres.Open(b.Context(), url, postgres.WithBatching(1, 0, 0),
		postgres.WithPoolConfig(func(c *pgxpool.Config) { c.MaxConns, c.MinConns = 1, 1 }))
	require.NoError(b, err)
	defer s.Close()
	backend := postgres.BackendPID(b, s)
	for _, n := range []int{1, 2, 4, 8} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			ctx := context.Background()
			run := 0
			keys := func() []storage.Key {
				run++
				ks := make([]storage.Key, n)
				for j := range ks {
					ks[j] = storage.Key{Consumer: "bench", Kind: storage.KindMessage, Key: fmt.Sprintf("%s-%d-%d-%d", b.Name(), b.N, run, j)}
				}
				return ks
			}
			db0, self0 := processCPU(backend), selfCPU()
			b.ResetTimer()
			for range b.N {
				ks := keys()
				claims := make([]storage.ClaimParams, n)
				for j, k := range ks {
					claims[j] = storage.ClaimParams{Key: k, Fingerprint: []byte("fingerprint-0123456789abcdef"), Lease: 30 * time.Second, Retention: 24 * time.Hour, Holder: "bench-holder"}
				}
				completes := make([]storage.CompleteParams, n)
				if n == 1 {
					res, err := s.Claim(ctx, claims[0])
					if err != nil || res.Outcome != storage.OutcomeAcquired {
						b.Fatal(res.Outcome, err)
					}
					if _, err := s.Complete(ctx, storage.CompleteParams{Key: ks[0], Token: res.Record.Token, Result: []byte("result-0123456789")}); err != nil {
						b.Fatal(err)
					}
					continue
				}
				for j, a := range s.ClaimBatch(ctx, claims) {
					if a.Err != nil || a.Result.Outcome != storage.OutcomeAcquired {
						b.Fatal(a.Result.Outcome, a.Err)
					}
					completes[j] = storage.CompleteParams{Key: ks[j], Token: a.Result.Record.Token, Result: []byte("result-0123456789")}
				}
				for _, a := range s.CompleteBatch(ctx, completes) {
					if a.Err != nil {
						b.Fatal(a.Err)
					}
				}
			}
			b.StopTimer()
			keysDone := float64(b.N * n)
			if db := processCPU(backend); db > 0 {
				b.ReportMetric(float64((db-db0).Microseconds())/keysDone, "db-µs/key")
				b.ReportMetric(float64((db-db0).Microseconds())/float64(b.N), "db-µs/pair-of-statements")
			}
			b.ReportMetric(float64((selfCPU()-self0).Microseconds())/keysDone, "go-µs/key")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/keysDone, "wall-µs/key")
		})
	}
}

// preload inserts n live records and analyzes the table, as a registry
// holding a retention window's records has it: the plans the benchmark's
// statements get are those of a table of some size, not of an empty one.
func preload(b *testing.B, url string, n int) {
	conn, err := pgx.Connect(b.Context(), url)
	require.NoError(b, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(b.Context(), `INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result)
SELECT 'preload', 1, 'key-' || g, 2, '\x0102', 1, 1, 'h', now(), now(), now(), now() + INTERVAL '1 day', 86400000000, '\x0102'
FROM generate_series(1, $1) g`, n)
	require.NoError(b, err)
	_, err = conn.Exec(b.Context(), `ANALYZE idemreg_records`)
	require.NoError(b, err)
}

// selfCPU is this process's user and system CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processCPU is a process's user and system CPU time so far, from
// /proc/PID/stat (clock ticks of 10 ms, so runs of a few seconds are needed),
// or 0 when it cannot be read.
func processCPU(pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := strings.LastIndexByte(string(raw), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}
