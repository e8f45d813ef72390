package client_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemreg/idemreg/client"
)

// BenchmarkQueue runs Claim+Complete pairs on new keys from concurrent
// callers through one Client, against the real service on the embedded
// store in memory (no fsync: the figures are the queue's shape, not the
// registry's throughput, which idemreg-bench measures), and reports RPCs
// per pair and items per Batch for each MaxInFlight:
//
//	go test -run '^$' -bench BenchmarkQueue -benchtime 4000x ./client/
func BenchmarkQueue(b *testing.B) {
	for _, callers := range []int{1, 8, 64} {
		for _, inFlight := range []int{1, 2, 4, 8} {
			b.Run(fmt.Sprintf("callers=%d/in-flight=%d", callers, inFlight), func(b *testing.B) {
				c, rec := serveCounted(b, false, client.Batching{MaxInFlight: inFlight})
				var next atomic.Int64
				var wg sync.WaitGroup
				b.ResetTimer()
				for range callers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							i := next.Add(1)
							if i > int64(b.N) {
								return
							}
							k := qkey(fmt.Sprint("bench", i))
							cl, err := c.Claim(b.Context(), client.ClaimParams{Key: k})
							if err != nil || cl.Outcome != client.OutcomeAcquired {
								b.Errorf("claim %d: %v %v", i, cl.Outcome, err)
								return
							}
							if _, err := c.Complete(b.Context(), k, cl.Fence(), client.ResponseResult("t", []byte("ok"))); err != nil {
								b.Errorf("complete %d: %v", i, err)
								return
							}
						}
					}()
				}
				wg.Wait()
				b.StopTimer()
				items := 0
				for _, s := range rec.batchShapes() {
					items += len(s)
				}
				batches := rec.count("Batch")
				rpcs := batches + rec.count("Claim") + rec.count("Complete")
				b.ReportMetric(float64(rpcs)/float64(b.N), "rpcs/pair")
				if batches > 0 {
					b.ReportMetric(float64(items)/float64(batches), "items/batch")
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
			})
		}
	}
}
