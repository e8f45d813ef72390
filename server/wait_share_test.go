package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// waitFloodDoc gives two identities a prefix each.
var waitFloodDoc = `
identities:
  - {name: flood, token_hashes: ["` + access.HashToken("flood-token") + `"], consumers: ["flood.*"]}
  - {name: calm, token_hashes: ["` + access.HashToken("calm-token") + `"], consumers: ["calm.*"]}
`

// waitingOn is a BatchClaim of consumer's keys k0..k<n-1>; with wait set,
// each item waits that long while its key is in progress.
func waitingOn(consumer, holder string, n int, wait time.Duration) *idemregv1.BatchClaimRequest {
	req := &idemregv1.BatchClaimRequest{}
	for i := range n {
		r := quotaClaim(consumer, fmt.Sprintf("k%d", i))
		r.Holder = holder
		if wait > 0 {
			r.Wait = durationpb.New(wait)
		}
		req.Requests = append(req.Requests, r)
	}
	return req
}

// waitsRefused reads idemreg.waits.refused by bound and identity.
func waitsRefused(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == server.MetricWaitsRefused {
				for _, dp := range sum.DataPoints {
					bound, _ := dp.Attributes.Value("bound")
					id, _ := dp.Attributes.Value("identity")
					out[bound.AsString()+"/"+id.AsString()] += dp.Value
				}
			}
		}
	}
	return out
}

// TestWaitShareIsolatesIdentities (issue 25, finding 3): an identity that
// makes as many Claims wait as the replica allows holds only its share of
// the waiters (half by default); the rest of its Claims answer at once,
// counted by idemreg.waits.refused, and another identity's Claim still
// waits for its key and gets the result of the holder's Complete.
func TestWaitShareIsolatesIdentities(t *testing.T) {
	const maxWaiters = 100
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			reader := sdkmetric.NewManualReader()
			addr, srv := servertest.Serve(t, b.open(t, &storagetest.Clock{}), server.Config{
				Access: accessFile(t, waitFloodDoc), MaxWaiters: maxWaiters,
				// No re-check while the flood waits: it only wakes for
				// what this replica does.
				WaitRecheck:   server.MaxWait,
				MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
			})
			c := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr))
			flood, calm := bearer(t.Context(), "flood-token"), bearer(t.Context(), "calm-token")

			// The flood holds as many keys as the replica has waiters,
			// then waits on every one of them at once.
			_, err := c.BatchClaim(flood, waitingOn("flood.a", "holder", maxWaiters, 0))
			require.NoError(t, err)
			floodCtx, stopFlood := context.WithCancel(flood)
			flooded := make(chan error, 1)
			go func() {
				_, err := c.BatchClaim(floodCtx, waitingOn("flood.a", "waiter", maxWaiters, 25*time.Second))
				flooded <- err
			}()
			require.Eventually(t, func() bool { return srv.Waiting() >= maxWaiters/2 }, 10*time.Second, time.Millisecond)

			// Another identity's Claim waits for its key, and gets the
			// holder's result.
			holder, err := c.Claim(calm, quotaClaim("calm.a", "k"))
			require.NoError(t, err)
			w := quotaClaim("calm.a", "k")
			w.Holder, w.Wait = "waiter", durationpb.New(20*time.Second)
			got := claimAsync(calm, c, w)
			require.Eventually(t, func() bool { return srv.Waiting() == maxWaiters/2+1 || len(got) > 0 }, 10*time.Second, time.Millisecond)
			require.Empty(t, got, "another identity's waiter was answered at once, without a wait")
			_, err = c.Complete(calm, &idemregv1.CompleteRequest{Consumer: "calm.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k",
				Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret(), Result: response("done")})
			require.NoError(t, err)
			a := <-got
			require.NoError(t, a.err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, a.res.GetOutcome(), "another identity's waiter gets its own Complete")
			require.Equal(t, "done", string(a.res.GetRecord().GetResult().GetResponse().GetData()))

			require.Equal(t, maxWaiters/2, srv.Waiting(), "the flood holds its share, no more")
			// The server's bound refused none (its series is there from
			// the start, at 0).
			require.Equal(t, map[string]int64{"identity/flood": maxWaiters / 2, "server/": 0}, waitsRefused(t, reader))
			stopFlood()
			require.Equal(t, codes.Canceled, status.Code(<-flooded))
			waitHarness{srv: srv}.waitersReach(t, 0)
		})
	}
}
