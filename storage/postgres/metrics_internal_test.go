package postgres

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestConflictTracer: the statements the store would retry are counted by
// their sqlstate, whatever wraps their error; no other failure is.
func TestConflictTracer(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	tr, err := newConflictTracer(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	require.NoError(t, err)
	for _, e := range []error{
		fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "40001"}),
		&pgconn.PgError{Code: "40001"},
		&pgconn.PgError{Code: "40P01"},
		&pgconn.PgError{Code: "23505"}, // not a conflict
		errors.New("connection reset"),
		nil,
	} {
		tr.TraceQueryEnd(t.Context(), nil, pgx.TraceQueryEndData{Err: e})
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			require.Equal(t, MetricConflicts, m.Name)
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value("sqlstate")
				got[v.AsString()] += dp.Value
			}
		}
	}
	require.Equal(t, map[string]int64{"40001": 2, "40P01": 1}, got)
}
