package server

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/storage"
)

// The parked records gauge.
//
// idemreg.parked_records is the number of live parked records per
// consumer, as the store counted them at the last count: every
// ParkedCountInterval the server asks the store for CountParked of every
// consumer, which the stores answer from their index of parked records,
// not a scan of all records. The count is the database's, so every
// replica on one database reports the same numbers: aggregate replicas
// with max, not sum. Collecting the metrics reads the last count and never
// calls the store. When a count fails, the last one stays (logged), so
// that an alert on parked records does not flap with the store.
//
// DefaultParkedCountInterval is how often the server counts the parked
// records for the gauge.
const DefaultParkedCountInterval = time.Minute

// MaxParkedGaugeConsumers bounds the consumers the gauge reports one by
// one: those with the most parked records; the others are summed under
// ParkedGaugeOther. Only an identity that invents consumer names under a
// prefix can park records under that many.
const MaxParkedGaugeConsumers = 1000

// ParkedGaugeOther is the consumer attribute of the parked records of the
// consumers beyond MaxParkedGaugeConsumers: not a valid consumer name, so
// it never mixes with one.
const ParkedGaugeOther = "(other)"

// parkedCounts keeps the last count of parked records per consumer.
type parkedCounts struct {
	// admin is nil when the store cannot count: the gauge reports nothing.
	admin  storage.Admin
	logger *slog.Logger
	last   atomic.Pointer[map[string]int64]
}

func newParkedCounts(backend storage.Store, logger *slog.Logger) *parkedCounts {
	p := &parkedCounts{logger: logger}
	p.admin, _ = backend.(storage.Admin)
	return p
}

// count asks the store for the parked records of every consumer and keeps
// the answer for the gauge.
func (p *parkedCounts) count(ctx context.Context) error {
	if p.admin == nil {
		return nil
	}
	counts, err := p.admin.CountParked(ctx, "")
	if err != nil {
		p.logger.Warn("counting parked records failed; the gauge keeps the last count", "error", err)
		return err
	}
	p.last.Store(&counts)
	return nil
}

// run counts at once, then every interval until ctx ends. A non-positive
// interval turns the gauge off.
func (p *parkedCounts) run(ctx context.Context, interval time.Duration) {
	if p.admin == nil || interval <= 0 {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		cctx, cancel := context.WithTimeout(ctx, interval)
		_ = p.count(cctx) // logged; the last count stays
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// observe reports the last count, the largest MaxParkedGaugeConsumers
// consumers one by one and the rest together.
func (p *parkedCounts) observe(obs metric.Observer, gauge metric.Int64ObservableGauge) {
	last := p.last.Load()
	if last == nil {
		return // nothing counted yet: no number rather than a false zero
	}
	type entry struct {
		consumer string
		n        int64
	}
	entries := make([]entry, 0, len(*last))
	for c, n := range *last {
		entries = append(entries, entry{c, n})
	}
	slices.SortFunc(entries, func(a, b entry) int { return cmp.Or(cmp.Compare(b.n, a.n), cmp.Compare(a.consumer, b.consumer)) })
	var other int64
	for i, e := range entries {
		if i >= MaxParkedGaugeConsumers {
			other += e.n
			continue
		}
		obs.ObserveInt64(gauge, e.n, metric.WithAttributes(attribute.String("consumer", e.consumer)))
	}
	if other > 0 {
		obs.ObserveInt64(gauge, other, metric.WithAttributes(attribute.String("consumer", ParkedGaugeOther)))
	}
}
