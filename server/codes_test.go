package server_test

import (
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
)

// TestCodesSpelledAlike: the access log, otelgrpc's call metrics and the
// registry's own metrics spell a gRPC code the same way, as google.rpc.Code
// does ("FAILED_PRECONDITION", not grpc-go's "FailedPrecondition"), so
// that a log line and a metric of the same calls match on it.
func TestCodesSpelledAlike(t *testing.T) {
	const token = "codes-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: billing
    token_hashes: ["`+access.HashToken(token)+`"]
    consumers: ["billing.*"]
`)
	var logs syncBuffer
	reader := sdkmetric.NewManualReader()
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src, Logger: jsonLogger(&logs),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}))
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	_, err := c.Claim(ctx, claimReq("codes-1", "fp-1"))
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("codes-1", "fp-2"))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)
	_, err = c.Claim(t.Context(), claimReq("codes-2", "fp-1"))
	requireStatus(t, err, codes.Unauthenticated, idemregv1.ReasonUnauthenticated)
	other := claimReq("codes-3", "fp-1")
	other.Consumer = "orders.inbox"
	_, err = c.Claim(ctx, other)
	requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)

	want := []string{"FAILED_PRECONDITION", "OK", "PERMISSION_DENIED", "UNAUTHENTICATED"}
	logged := map[string]bool{}
	for _, line := range logs.waitLines(t, "finished call", 4) {
		logged[line["grpc.code"].(string)] = true
	}
	require.Equal(t, want, slices.Sorted(maps.Keys(logged)), "the access log")

	// by returns the values of attribute key on the data points of metric.
	by := func(metric, key string) []string {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(t.Context(), &rm))
		seen := map[string]bool{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if m.Name != metric {
					continue
				}
				switch d := m.Data.(type) {
				case metricdata.Histogram[float64]:
					for _, dp := range d.DataPoints {
						v, _ := dp.Attributes.Value(attribute.Key(key))
						seen[v.AsString()] = true
					}
				case metricdata.Sum[int64]:
					for _, dp := range d.DataPoints {
						v, _ := dp.Attributes.Value(attribute.Key(key))
						seen[v.AsString()] = true
					}
				}
			}
		}
		return slices.Sorted(maps.Keys(seen))
	}
	// The server records a call after its status is sent.
	require.Eventually(t, func() bool {
		return slices.Equal(want, by("rpc.server.call.duration", "rpc.response.status_code"))
	}, 5*time.Second, 10*time.Millisecond, "otelgrpc: %v", by("rpc.server.call.duration", "rpc.response.status_code"))
	require.Equal(t, []string{"PERMISSION_DENIED", "UNAUTHENTICATED"}, by(server.MetricDenied, "code"), server.MetricDenied)
}
