package pebble

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemreg/idemreg/storage"
)

func BenchmarkClaimComplete(b *testing.B) {
	s := openT(b, b.TempDir())
	procs := runtime.GOMAXPROCS(0)
	b.SetParallelism((64 + procs - 1) / procs)
	var seq atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			k := storage.Key{Consumer: "bench", Kind: storage.KindOperation, Key: strconv.FormatInt(seq.Add(1), 10)}
			res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Fingerprint: []byte("fingerprint"), Lease: time.Minute, Retention: time.Hour, Holder: "bench"})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("a small result")}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
}
