package server_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestRateLimitAcrossReplicas: three replicas on one PostgreSQL database
// find each other through the membership and each fills its buckets at a
// third of the config file's rate, so that a caller spreading its calls
// over them round-robin gets the service's rate (within 20%), not three
// times it; when one replica leaves, the two left take half each.
func TestRateLimitAcrossReplicas(t *testing.T) {
	const rate, burst = 60, 6
	doc := fmt.Sprintf("rate_limits:\n  - consumers: [\"billing.*\"]\n    rate: %d\n    burst: %d\n", rate, burst)
	db := pgtest.NewDatabase(t)
	rs := make([]*peerReplica, 3)
	for i := range rs {
		cfg := replicaConfig(time.Second)
		cfg.File = quotaFile(t, doc)
		rs[i] = startPeer(t, db, cfg)
	}
	seeEachOther(t, rs...)

	// spread Claims new keys round-robin over rs from 24 callers for d,
	// and returns how many were admitted, and the rate the service should
	// have admitted over the time they took. 24, not 6: on a loaded machine
	// (CI at load 40) 6 callers offered a replica less than its share at
	// moments, its bucket stood full, and 98 were admitted where 127 were
	// due.
	var seq atomic.Int64
	spread := func(rs []*peerReplica, d time.Duration) (admitted int64, want float64) {
		var wg sync.WaitGroup
		var ok, limited atomic.Int64
		start := time.Now()
		for range 24 {
			wg.Go(func() {
				for time.Since(start) < d {
					n := seq.Add(1)
					_, err := rs[n%int64(len(rs))].c.Claim(t.Context(), claimReq(fmt.Sprint("rl-", n), "fp"))
					switch status.Code(err) {
					case codes.OK:
						ok.Add(1)
					case codes.ResourceExhausted:
						limited.Add(1)
					default:
						t.Errorf("claim: %v", err)
						return
					}
				}
			})
		}
		wg.Wait()
		elapsed := time.Since(start).Seconds()
		t.Logf("%d replicas, %.2f s: %d admitted, %d refused RATE_LIMITED", len(rs), elapsed, ok.Load(), limited.Load())
		require.Greater(t, limited.Load(), ok.Load()/2, "the callers offered well over the rate")
		return ok.Load(), burst + rate*elapsed
	}

	admitted, want := spread(rs, 2*time.Second)
	require.InEpsilon(t, want, float64(admitted), 0.2, "the service's rate, not three times it (%.0f)", 3*want)

	rs[2].stop()
	seeEachOther(t, rs[:2]...)
	time.Sleep(time.Second) // the buckets refill, at their new rate
	admitted, want = spread(rs[:2], 2*time.Second)
	require.InEpsilon(t, want, float64(admitted), 0.2, "two replicas left: half each")
}
