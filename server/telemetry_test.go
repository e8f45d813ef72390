package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// counterSeries collects reader's int64 sums as "name k=v k=v" → value,
// attributes in their set's (sorted) order.
func counterSeries(t *testing.T, reader sdkmetric.Reader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range d.DataPoints {
					key := m.Name
					for _, kv := range dp.Attributes.ToSlice() {
						key += " " + string(kv.Key) + "=" + kv.Value.Emit()
					}
					out[key] += dp.Value
				}
			}
		}
	}
	return out
}

// TestCountersStartAtZero: a fresh server's counters are there before
// their first event, at 0, so that an alert on rate() sees a series.
func TestCountersStartAtZero(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	start(t, memStore(t), server.Config{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	got := counterSeries(t, reader)
	for _, series := range []string{
		server.MetricClaims + " outcome=" + server.ClaimAcquired,
		server.MetricClaims + " outcome=" + server.ClaimInProgress,
		server.MetricCompletes, server.MetricReleases, server.MetricExtends, server.MetricParks,
		server.MetricLeaseLost + " method=complete",
		server.MetricLeaseLost + " method=extend",
		server.MetricOverloaded + " bound=server",
		server.MetricStoreErrors + " error.type=unavailable op=claim",
		server.MetricStoreErrors + " error.type=deadline op=complete",
		server.MetricRateLimited + " identity=anonymous",
		server.MetricDenied + " code=UNAUTHENTICATED",
		server.MetricDenied + " code=PERMISSION_DENIED",
		server.MetricBoundRefused + " bound=public_streams",
		server.MetricBoundRefused + " bound=pending_calls",
		server.MetricBoundRefused + " bound=identity_calls",
		server.MetricWaits + " ended=" + server.WaitElapsed,
		server.MetricWaitsRefused + " bound=server",
	} {
		v, ok := got[series]
		require.True(t, ok, "series %q missing; got %v", series, got)
		require.Zero(t, v, series)
	}
	require.NotContains(t, got, server.MetricLeaseLost+" method=resolve", "an operator's race is no stale holder")
}

// TestOperatorRaceIsNotLeaseLost: an operator's Resolve or Invalidate with
// a token that is no longer current counts as
// idemreg.admin.actions{result=LEASE_LOST}, not as idemreg.lease_lost,
// which counts stale holders alone.
func TestOperatorRaceIsNotLeaseLost(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	conn := start(t, memStore(t), server.Config{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	c, admin := idemregv1.NewRegistryServiceClient(conn), idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	first, err := c.Claim(ctx, claimReq("race-1", "fp"))
	require.NoError(t, err)

	_, err = admin.ResolveRecord(ctx, &idemregv1.ResolveRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
		Key: "race-1", Token: first.GetToken() + 1, Reason: "stuck", Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
	_, err = admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
		Key: "race-1", Token: first.GetToken() + 1, Reason: "stuck"})
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
	got := counterSeries(t, reader)
	require.EqualValues(t, 1, got[server.MetricAdminActions+" action=resolve result=LEASE_LOST"], "%v", got)
	require.EqualValues(t, 1, got[server.MetricAdminActions+" action=invalidate result=LEASE_LOST"], "%v", got)
	for series, v := range got {
		if len(series) > len(server.MetricLeaseLost) && series[:len(server.MetricLeaseLost)+1] == server.MetricLeaseLost+" " {
			require.Zero(t, v, "%s: an operator's race is no stale holder", series)
		}
	}

	// A holder's stale token still counts.
	_, err = admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
		Key: "race-1", Token: first.GetToken(), Reason: "stuck"})
	require.NoError(t, err)
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "race-1",
		Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("late")})
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
	require.EqualValues(t, 1, counterSeries(t, reader)[server.MetricLeaseLost+" method=complete"])
}
