package retention

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// MeterName is the instrumentation scope of the sweeper's instruments.
const MeterName = "github.com/idemreg/idemreg/retention"

// Instrument names, documented in docs/retention.md.
const (
	MetricDeleted       = "idemreg.sweeper.deleted"
	MetricBatches       = "idemreg.sweeper.batches"
	MetricErrors        = "idemreg.sweeper.errors"
	MetricBatchDuration = "idemreg.sweeper.batch.duration"
	MetricPassDuration  = "idemreg.sweeper.pass.duration"
	MetricBatchSize     = "idemreg.sweeper.batch.size"
	MetricLag           = "idemreg.sweeper.lag"
)

// Attribute values.
const (
	outcomeOK      = "ok"
	outcomeTimeout = "timeout"
	outcomeError   = "error"
)

type instruments struct {
	deleted       metric.Int64Counter
	batches       metric.Int64Counter
	errors        metric.Int64Counter
	batchDuration metric.Float64Histogram
	passDuration  metric.Float64Histogram
	batchSize     metric.Int64Gauge
	lag           metric.Float64Gauge
}

func newInstruments(mp metric.MeterProvider) (*instruments, error) {
	m := mp.Meter(MeterName)
	var (
		in  instruments
		err error
		all []error
	)
	add := func(e error) {
		if e != nil {
			all = append(all, e)
		}
	}
	in.deleted, err = m.Int64Counter(MetricDeleted, metric.WithUnit("{record}"),
		metric.WithDescription("Expired records the sweeper deleted."))
	add(err)
	in.batches, err = m.Int64Counter(MetricBatches, metric.WithUnit("{batch}"),
		metric.WithDescription("Delete batches the sweeper ran, by outcome (ok, timeout, error)."))
	add(err)
	in.errors, err = m.Int64Counter(MetricErrors, metric.WithUnit("{error}"),
		metric.WithDescription("Failed store calls of the sweeper, by operation (sweep, oldest_expiry) and error type (timeout, error)."))
	add(err)
	in.batchDuration, err = m.Float64Histogram(MetricBatchDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of one delete batch, by outcome."),
		metric.WithExplicitBucketBoundaries(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
	add(err)
	in.passDuration, err = m.Float64Histogram(MetricPassDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of one sweep pass, by how it ended (finished, max_duration, canceled, failed)."),
		metric.WithExplicitBucketBoundaries(0.01, 0.1, 1, 10, 60, 300, 900, 1800, 3600, 7200))
	add(err)
	in.batchSize, err = m.Int64Gauge(MetricBatchSize, metric.WithUnit("{record}"),
		metric.WithDescription("The current batch size, which shrinks after timeouts."))
	add(err)
	in.lag, err = m.Float64Gauge(MetricLag, metric.WithUnit("s"),
		metric.WithDescription("How long the oldest expired record has been expired, by the store's clock; 0 when none is."))
	add(err)
	if len(all) > 0 {
		return nil, fmt.Errorf("retention: metrics: %v", all)
	}
	return &in, nil
}

func outcomeAttr(v string) metric.MeasurementOption {
	return metric.WithAttributes(attribute.String("outcome", v))
}

func (in *instruments) batchFailed(ctx context.Context, timeout bool, seconds float64) {
	outcome := outcomeError
	if timeout {
		outcome = outcomeTimeout
	}
	in.batches.Add(ctx, 1, outcomeAttr(outcome))
	in.batchDuration.Record(ctx, seconds, outcomeAttr(outcome))
	in.errors.Add(ctx, 1, metric.WithAttributes(attribute.String("op", "sweep"), attribute.String("error.type", outcome)))
}

func (in *instruments) batchDone(ctx context.Context, deleted int, seconds float64) {
	in.deleted.Add(ctx, int64(deleted))
	in.batches.Add(ctx, 1, outcomeAttr(outcomeOK))
	in.batchDuration.Record(ctx, seconds, outcomeAttr(outcomeOK))
}

func attrsOldestExpiryError(err error) metric.AddOption {
	kind := outcomeError
	if errors.Is(err, context.DeadlineExceeded) {
		kind = outcomeTimeout
	}
	return metric.WithAttributes(attribute.String("op", "oldest_expiry"), attribute.String("error.type", kind))
}
