package admission

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	runtimemetrics "runtime/metrics"
	"sync/atomic"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// memoryGuard watches the live heap against the process's memory limit
// (GOMEMLIMIT, debug.SetMemoryLimit): near it the garbage collector runs
// almost without pause, and past it the process is killed by its cgroup
// rather than slowed. From memoryWarnRatio of the limit it logs; from
// memoryRefuseRatio it refuses Claims (RESOURCE_EXHAUSTED,
// CAPACITY_EXHAUSTED, resource memory), the calls that start work and
// hold memory the longest (waiters, quota follows), while Completes,
// Releases, Extends and reads go on and finish what is held. Without a
// limit it does nothing. The figures are the runtime's
// (/gc/heap/live:bytes, as of the last collection; on /metrics as
// go_memstats_heap_inuse_bytes against go_gc_gomemlimit_bytes).
type memoryGuard struct {
	logger *slog.Logger
	// refusing is set while Claims are refused; level is the last level
	// logged (0 ok, 1 warn, 2 refusing).
	refusing atomic.Bool
	level    int
	live     atomic.Int64
	limit    atomic.Int64
}

const (
	memoryWarnRatio   = 0.85
	memoryRefuseRatio = 0.95
	memoryInterval    = time.Second
)

var memorySamples = []string{"/gc/heap/live:bytes", "/gc/gomemlimit:bytes"}

// measure reads the runtime's figures and logs a change of level.
func (g *memoryGuard) measure() {
	s := []runtimemetrics.Sample{{Name: memorySamples[0]}, {Name: memorySamples[1]}}
	runtimemetrics.Read(s)
	if s[0].Value.Kind() != runtimemetrics.KindUint64 || s[1].Value.Kind() != runtimemetrics.KindUint64 {
		return
	}
	live, limit := s[0].Value.Uint64(), s[1].Value.Uint64()
	if limit == 0 || limit >= math.MaxInt64 {
		g.refusing.Store(false)
		return // no limit set
	}
	g.live.Store(int64(live))
	g.limit.Store(int64(limit))
	level := 0
	switch r := float64(live) / float64(limit); {
	case r >= memoryRefuseRatio:
		level = 2
	case r >= memoryWarnRatio:
		level = 1
	}
	g.refusing.Store(level == 2)
	if level == g.level {
		return
	}
	attrs := []any{"live_heap_bytes", live, "memory_limit_bytes", limit, "warn_ratio", memoryWarnRatio, "refuse_ratio", memoryRefuseRatio}
	switch level {
	case 2:
		g.logger.Error("live heap near the memory limit: refusing Claims; Completes, Releases, Extends and reads go on", attrs...)
	case 1:
		g.logger.Warn("live heap nearing the memory limit: Claims will be refused above the refuse ratio", attrs...)
	default:
		g.logger.Info("live heap well under the memory limit again", attrs...)
	}
	g.level = level
}

func (g *memoryGuard) run(ctx context.Context) {
	t := time.NewTicker(memoryInterval)
	defer t.Stop()
	for {
		g.measure()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refuse is the refusal of a Claim while the heap is near its limit.
func (g *memoryGuard) refuse() error {
	if g == nil || !g.refusing.Load() {
		return nil
	}
	return &storage.ExhaustedError{Resource: storage.ResourceMemory,
		Detail: fmt.Sprintf("Claim refused: live heap %d bytes of a %d-byte memory limit", g.live.Load(), g.limit.Load())}
}
