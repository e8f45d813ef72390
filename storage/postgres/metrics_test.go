package postgres_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestPoolMetrics: the pool's statistics are observed: connections by
// state, acquires and the time they took.
func TestPoolMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := openStore(t, pgtest.NewDatabase(t), postgres.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	for i := range 3 {
		_, err := s.Claim(t.Context(), storage.ClaimParams{Key: storage.Key{Consumer: "pool.metrics", Kind: storage.KindOperation,
			Key: string(rune('a' + i))}, Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	ints, floats := map[string]int64{}, map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					ints[m.Name] += dp.Value
				}
			case metricdata.Gauge[int64]:
				for _, dp := range d.DataPoints {
					ints[m.Name] += dp.Value
				}
			case metricdata.Sum[float64]:
				for _, dp := range d.DataPoints {
					floats[m.Name] += dp.Value
				}
			}
		}
	}
	require.GreaterOrEqual(t, ints[postgres.MetricPoolAcquires], int64(3), "a Claim acquires a connection; got %v", ints)
	require.Greater(t, floats[postgres.MetricPoolAcquireDuration], 0.0, "%v", floats)
	require.GreaterOrEqual(t, ints[postgres.MetricPoolOpened], int64(1))
	require.GreaterOrEqual(t, ints[postgres.MetricPoolConnections], int64(1), "connections by state add up to the total")
	require.Positive(t, ints[postgres.MetricPoolMaxConnections])
	require.Contains(t, ints, postgres.MetricPoolCanceledAcquires)
	require.Contains(t, ints, postgres.MetricPoolEmptyAcquires)
	require.Contains(t, floats, postgres.MetricPoolAcquireWait)
}
