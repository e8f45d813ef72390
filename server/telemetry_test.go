package server_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	otelcodes "go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/storagetest"
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
		server.MetricQuotaRefreshes + " result=ok",
		server.MetricQuotaRefreshes + " result=failed",
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

// TestTraces: with a recording tracer, a call's span (otelgrpc's) carries
// the consumer, kind, identity and outcome, and each record operation has
// a child span named by the operation, never with SQL or values in it.
func TestTraces(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			conn := start(t, b.open(t, &storagetest.Clock{}), server.Config{TracerProvider: tp})
			c := idemregv1.NewRegistryServiceClient(conn)
			ctx := t.Context()
			first, err := c.Claim(ctx, claimReq("tr-1", "fp"))
			require.NoError(t, err)
			_, err = c.Claim(ctx, claimReq("tr-1", "fp")) // in progress
			require.NoError(t, err)
			_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
				Key: "tr-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret()})
			require.NoError(t, err)
			_, err = c.Claim(ctx, claimReq("tr-1", "fp")) // takeover
			require.NoError(t, err)
			_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
				Key: "tr-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret()}) // a stale holder
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)

			// otelgrpc ends the server span after the response went out.
			require.Eventually(t, func() bool { return len(rec.Ended()) >= 10 }, 10*time.Second, 5*time.Millisecond, "%v", spanNames(rec.Ended()))
			var calls, stores []sdktrace.ReadOnlySpan
			for _, s := range rec.Ended() {
				switch {
				case s.SpanKind() == trace.SpanKindServer:
					calls = append(calls, s)
				case strings.HasPrefix(s.Name(), "store "):
					stores = append(stores, s)
				}
			}
			// Ended in any order (a span ends after its response went
			// out); started in the calls' order.
			byStart := func(a, b sdktrace.ReadOnlySpan) int { return a.StartTime().Compare(b.StartTime()) }
			slices.SortFunc(calls, byStart)
			slices.SortFunc(stores, byStart)
			require.Len(t, calls, 5)
			require.Len(t, stores, 5)
			attrsOf := func(s sdktrace.ReadOnlySpan) map[string]string {
				out := map[string]string{}
				for _, kv := range s.Attributes() {
					out[string(kv.Key)] = kv.Value.Emit()
				}
				return out
			}
			wantOutcomes := []string{"OUTCOME_ACQUIRED", "OUTCOME_IN_PROGRESS", "OK", "OUTCOME_ACQUIRED", "LEASE_LOST"}
			wantStores := []string{"store claim", "store claim", "store release", "store claim", "store extend"}
			for i, call := range calls {
				a := attrsOf(call)
				require.Equal(t, "billing.payment-worker", a[string(server.AttrConsumer)], call.Name())
				require.Equal(t, "KIND_OPERATION", a[string(server.AttrKind)], call.Name())
				require.Equal(t, "anonymous", a[string(server.AttrIdentity)], call.Name())
				require.Equal(t, wantOutcomes[i], a[string(server.AttrOutcome)], call.Name())

				var child sdktrace.ReadOnlySpan
				for _, s := range stores {
					if s.Parent().SpanID() == call.SpanContext().SpanID() {
						require.Nil(t, child, "one store span per store call")
						child = s
					}
				}
				require.NotNil(t, child, "%s has a store span", call.Name())
				require.Equal(t, wantStores[i], child.Name())
				require.Equal(t, trace.SpanKindClient, child.SpanKind())
				ca := attrsOf(child)
				require.Equal(t, strings.TrimPrefix(wantStores[i], "store "), ca["db.operation.name"])
				for k, v := range ca {
					require.NotContains(t, strings.ToUpper(v), "SELECT", k)
					require.NotContains(t, v, "tr-1", "%s: no values in the store span", k)
				}
			}
			require.Equal(t, "LEASE_LOST", attrsOf(stores[4])["idemreg.reason"], "an answer, not a failure")
			require.Equal(t, otelcodes.Unset, stores[4].Status().Code)
		})
	}
}

// TestNoStoreSpanWhenNotRecording: with tracing on but the call not
// sampled, no store span is opened.
func TestNoStoreSpanWhenNotRecording(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sdktrace.NeverSample()))
	conn := start(t, memStore(t), server.Config{TracerProvider: tp})
	_, err := idemregv1.NewRegistryServiceClient(conn).Claim(t.Context(), claimReq("tr-2", "fp"))
	require.NoError(t, err)
	require.Empty(t, rec.Started())
}

func spanNames(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name())
	}
	return out
}
