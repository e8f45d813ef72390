package pebble_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

// TestPebbleMetrics: Pebble's own statistics (memtables, flushes,
// compactions, debt, read amplification) are observed beside the disk's.
func TestPebbleMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s, err := pebble.Open(t.TempDir(), pebble.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	for i := range 10 {
		_, err := s.Claim(t.Context(), storage.ClaimParams{Key: storage.Key{Consumer: "pebble.metrics", Kind: storage.KindOperation,
			Key: fmt.Sprint(i)}, Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					got[m.Name] += dp.Value
				}
			case metricdata.Gauge[int64]:
				for _, dp := range d.DataPoints {
					got[m.Name] += dp.Value
				}
			}
		}
	}
	require.GreaterOrEqual(t, got[pebble.MetricMemtableCount], int64(1), "%v", got)
	require.Positive(t, got[pebble.MetricMemtableSize], "the claims are in the memtable")
	for _, name := range []string{pebble.MetricFlushes, pebble.MetricCompactions, pebble.MetricCompactionsRunning,
		pebble.MetricCompactionDebt, pebble.MetricReadAmp, pebble.MetricSize} {
		require.Contains(t, got, name)
	}
}
