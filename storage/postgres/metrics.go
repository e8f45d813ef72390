package postgres

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/multitracer"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// MeterName is the instrumentation scope of the store's instruments.
const MeterName = "github.com/idemreg/idemreg/storage/postgres"

// MetricConflicts counts the statements the database aborted with a
// failure the store retries (retryable: a serialization failure, 40001 or
// CockroachDB's CR000, or a deadlock, 40P01), by sqlstate. The store
// retries each while its retry budget and the call's deadline last, so
// this is the number of store retries, plus the last, failed attempt of a
// call whose retries ran out (which the server's idemreg.store.errors
// counts too).
const MetricConflicts = "idemreg.store.conflicts"

// WithMeterProvider sets where the store's instruments are made (default:
// otel.GetMeterProvider() when Open runs).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) { o.meterProvider = mp }
}

// conflictTracer is the pgx tracer that counts MetricConflicts. It sees
// every statement's end, those of coalesced batches and of the retry loop
// alike, and classifies with retryable, as the retry loop does.
type conflictTracer struct{ conflicts metric.Int64Counter }

func newConflictTracer(mp metric.MeterProvider) (*conflictTracer, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	c, err := mp.Meter(MeterName).Int64Counter(MetricConflicts, metric.WithUnit("{statement}"),
		metric.WithDescription("SQL statements aborted by a serialization failure or a deadlock, each retried by the store while its budget lasts; by sqlstate."))
	if err != nil {
		return nil, err
	}
	return &conflictTracer{conflicts: c}, nil
}

func (c *conflictTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c *conflictTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if data.Err != nil && retryable(data.Err) {
		c.conflicts.Add(ctx, 1, metric.WithAttributes(attribute.String("sqlstate", sqlState(data.Err))))
	}
}

// queryTracer is the connections' tracer: the store's own, and the
// caller's (WithTracer) beside it.
func (o *options) queryTracer() (pgx.QueryTracer, error) {
	own, err := newConflictTracer(o.meterProvider)
	if err != nil {
		return nil, err
	}
	if o.tracer == nil {
		return own, nil
	}
	return multitracer.New(own, o.tracer), nil
}
