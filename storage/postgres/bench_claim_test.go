package postgres_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// BenchmarkClaimComplete runs claim+complete pairs of new keys from 64
// goroutines on the store, with coalescing on (the default) and off, and
// reports pairs per second and the calls per statement. It prints figures
// and asserts none.
func BenchmarkClaimComplete(b *testing.B) {
	databaseURL := pgtest.NewDatabase(b)
	for _, bc := range []struct {
		name string
		opts []postgres.Option
	}{
		{"coalesced", nil},
		{"alone", []postgres.Option{postgres.WithBatching(1, 0, 0)}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := postgres.Open(b.Context(), databaseURL, bc.opts...)
			require.NoError(b, err)
			defer s.Close()
			var seq atomic.Int64
			prefix := fmt.Sprintf("%s-%d-", bc.name, time.Now().UnixNano())
			var b0, c0, s0 int64
			if bc.name != "alone" {
				b0, c0 = postgres.BatchStats(s)
				s0 = postgres.BatchSplits(s)
			}
			b.SetParallelism((64 + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					k := storage.Key{Consumer: "bench", Kind: storage.KindMessage, Key: prefix + strconv.FormatInt(seq.Add(1), 10)}
					res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Fingerprint: []byte("fp"), Lease: time.Minute, Retention: time.Hour, Holder: "bench"})
					if err != nil {
						b.Error(err)
						return
					}
					if _, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("a small result")}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
			if bc.name != "alone" {
				batches, calls := postgres.BatchStats(s)
				b.ReportMetric(float64(calls-c0)/float64(max(batches-b0, 1)), "calls/batch")
				b.ReportMetric(float64(batches-b0), "batches")
				b.ReportMetric(float64(postgres.BatchSplits(s)-s0), "splits")
			}
		})
	}
}
