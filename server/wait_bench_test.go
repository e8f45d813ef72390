package server_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
)

// BenchmarkWaitFlood measures what one identity's waits make a replica
// hold at the default bounds (issue 25, finding 3): it holds 10,000 keys
// of its own and waits on all of them at once, in 20 BatchClaims of 500
// items, against the in-memory embedded store. Reported: the Claims that
// wait (waiters), the memory they hold (mem-MB: heap and goroutine
// stacks in use after a GC, less before the flood), the process's CPU while they wait (cpu-cores, over 2 s:
// their re-checks every --wait-recheck), and whether another identity's
// Claim still waits for its key and gets its holder's result
// (other-waited, 1 or 0). Figures, not a pass or fail: one iteration is
// the whole flood. With the default re-check (100ms), some of the flood's
// re-checks are refused by its share of the store's slots
// (--max-in-flight-per-identity) and end their waits with OVERLOADED, so
// fewer wait; with re-checks 30 s apart every item that may wait does.
//
//	go test -run '^$' -bench WaitFlood -benchtime 1x ./server/
func BenchmarkWaitFlood(b *testing.B) {
	for _, recheck := range []time.Duration{server.DefaultWaitRecheck, server.MaxWait} {
		b.Run("recheck="+recheck.String(), func(b *testing.B) { benchmarkWaitFlood(b, recheck) })
	}
}

func benchmarkWaitFlood(b *testing.B, recheck time.Duration) {
	const batches = 20
	addr, srv := servertest.Serve(b, memStore(b), server.Config{Access: accessFile(b, waitFloodDoc), WaitRecheck: recheck})
	conns := make([]idemregv1.RegistryServiceClient, 4) // 64 calls per connection at most
	for i := range conns {
		conns[i] = idemregv1.NewRegistryServiceClient(servertest.Dial(b, addr))
	}
	c := conns[0]
	for n := range b.N {
		flood, calm := bearer(b.Context(), "flood-token"), bearer(b.Context(), "calm-token")
		consumer := fmt.Sprintf("flood.r%d-", n)
		for i := range batches {
			_, err := c.BatchClaim(flood, waitingOn(fmt.Sprint(consumer, i), "holder", server.MaxBatchItems, 0))
			require.NoError(b, err)
		}
		mem0 := heapAndStacks()
		floodCtx, stop := context.WithCancel(flood)
		var wg sync.WaitGroup
		for i := range batches {
			wg.Go(func() {
				_, _ = conns[i%len(conns)].BatchClaim(floodCtx, waitingOn(fmt.Sprint(consumer, i), "waiter", server.MaxBatchItems, 25*time.Second))
			})
		}
		// Every item decided: those that wait are asleep, the others
		// answered (the most asleep at once, polled every 10ms for 1 s
		// after the count stops rising).
		waiters, last := 0, time.Now()
		for time.Since(last) < time.Second {
			if n := srv.Waiting(); n > waiters {
				waiters, last = n, time.Now()
			}
			time.Sleep(10 * time.Millisecond)
		}
		cpu0, t0 := cpuTime(), time.Now()
		time.Sleep(2 * time.Second)
		cores := (cpuTime() - cpu0).Seconds() / time.Since(t0).Seconds()
		mem := heapAndStacks() - mem0

		key := fmt.Sprintf("k%d", n)
		holder, err := c.Claim(calm, quotaClaim("calm.a", key))
		require.NoError(b, err)
		w := quotaClaim("calm.a", key)
		w.Holder, w.Wait = "waiter", durationpb.New(20*time.Second)
		got := claimAsync(calm, conns[1], w)
		time.Sleep(200 * time.Millisecond) // a refused waiter has answered by then
		answeredAtOnce := len(got) > 0
		_, err = c.Complete(calm, &idemregv1.CompleteRequest{Consumer: "calm.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
			Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret(), Result: response("done")})
		require.NoError(b, err)
		a := <-got
		require.NoError(b, a.err)
		waited := 0.0
		if !answeredAtOnce && a.res.GetOutcome() == idemregv1.Outcome_OUTCOME_COMPLETED {
			waited = 1
		}

		stop()
		wg.Wait()
		b.ReportMetric(float64(waiters), "waiters")
		b.ReportMetric(float64(mem)/(1<<20), "mem-MB")
		b.ReportMetric(cores, "cpu-cores")
		b.ReportMetric(waited, "other-waited")
	}
}

// heapAndStacks is the heap and the goroutine stacks in use, after a
// collection: a waiting Claim holds both.
func heapAndStacks() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse + m.StackInuse)
}
