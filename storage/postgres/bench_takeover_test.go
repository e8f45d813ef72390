package postgres_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// BenchmarkClaimTakeover runs Claims that each take over the record the
// Claim before it on the key held (a lease of a microsecond), from eight
// goroutines per CPU on keys of their own, without coalescing: the
// conflict branch of the Claim statement, where the history is written. It
// prints figures and asserts none.
func BenchmarkClaimTakeover(b *testing.B) {
	s, err := postgres.Open(b.Context(), pgtest.NewDatabase(b), postgres.WithBatching(1, 0, 0))
	require.NoError(b, err)
	defer s.Close()
	var worker atomic.Int64
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		w := worker.Add(1)
		for i := 0; pb.Next(); i++ {
			k := storage.Key{Consumer: "bench", Kind: storage.KindOperation, Key: fmt.Sprintf("w%d-k%d", w, i%16)}
			res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Fingerprint: []byte("fp"), Lease: time.Microsecond, Retention: time.Hour, Holder: "bench"})
			if err != nil {
				b.Error(err)
				return
			}
			if res.Outcome != storage.OutcomeAcquired {
				b.Errorf("outcome %d", res.Outcome)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "claims/s")
}
