package admission

import (
	"log/slog"
	"math"
	"runtime"
	"runtime/debug"
	runtimemetrics "runtime/metrics"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// TestMemoryGuard: with the memory limit just above the live heap, Claims
// are refused (CAPACITY_EXHAUSTED, memory); with none, they are not.
func TestMemoryGuard(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	runtime.GC()
	s := []runtimemetrics.Sample{{Name: "/gc/heap/live:bytes"}}
	runtimemetrics.Read(s)
	g := &memoryGuard{logger: slog.New(slog.DiscardHandler)}
	debug.SetMemoryLimit(int64(float64(s[0].Value.Uint64()) / (memoryRefuseRatio + 0.02)))
	g.measure()
	err := g.refuse()
	require.ErrorIs(t, err, storage.ErrExhausted)
	var ex *storage.ExhaustedError
	require.ErrorAs(t, err, &ex)
	require.Equal(t, storage.ResourceMemory, ex.Resource)
	debug.SetMemoryLimit(math.MaxInt64)
	g.measure()
	require.NoError(t, g.refuse())
}
