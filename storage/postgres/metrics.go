package postgres

import (
	"context"
	"errors"

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

// A batch (the queue's transaction of Claims and Completes, batch.go) is
// one transaction: its conflict is counted once, at its end.

func (c *conflictTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *conflictTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *conflictTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
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

// The pool's instruments: how close the replica is to its connections'
// bound (the connections by state add up to the pool's total), and how
// long calls wait for one (Prometheus:
// idemreg_store_pool_connections, idemreg_store_pool_max_connections,
// idemreg_store_pool_empty_acquires_total,
// idemreg_store_pool_acquire_wait_seconds_total). A wait that grows means
// the pool is the bottleneck: --max-in-flight turns the excess into
// OVERLOADED before it queues here; the database's own bound
// (max_connections) is answered CAPACITY_EXHAUSTED, resource connections.
const (
	MetricPoolConnections    = "idemreg.store.pool.connections"
	MetricPoolMaxConnections = "idemreg.store.pool.max_connections"
	MetricPoolEmptyAcquires  = "idemreg.store.pool.empty_acquires"
	MetricPoolAcquireWait    = "idemreg.store.pool.acquire_wait"
	// MetricPoolAcquires counts every acquire of a connection (one per
	// store statement or transaction), MetricPoolAcquireDuration the time
	// they took in all, waits included: their ratio is the mean acquire
	// time. MetricPoolCanceledAcquires counts the acquires given up (the
	// call's context ended while it waited), MetricPoolOpened the
	// connections the pool opened (a count that keeps growing means
	// connections are lost or recycled).
	MetricPoolAcquires         = "idemreg.store.pool.acquires"
	MetricPoolAcquireDuration  = "idemreg.store.pool.acquire_duration"
	MetricPoolCanceledAcquires = "idemreg.store.pool.canceled_acquires"
	MetricPoolOpened           = "idemreg.store.pool.opened"
)

// instrumentPool registers the pool's instruments until Close.
func (s *Store) instrumentPool(mp metric.MeterProvider) (metric.Registration, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(MeterName)
	conns, err1 := m.Int64ObservableGauge(MetricPoolConnections, metric.WithUnit("{connection}"),
		metric.WithDescription("Connections of the store's pool, by state (acquired, idle, constructing)."))
	maxConns, err2 := m.Int64ObservableGauge(MetricPoolMaxConnections, metric.WithUnit("{connection}"),
		metric.WithDescription("The most connections the store's pool opens (pool_max_conns)."))
	empty, err3 := m.Int64ObservableCounter(MetricPoolEmptyAcquires, metric.WithUnit("{acquire}"),
		metric.WithDescription("Acquires of a connection that found none idle and waited or opened one."))
	wait, err4 := m.Float64ObservableCounter(MetricPoolAcquireWait, metric.WithUnit("s"),
		metric.WithDescription("Time calls spent waiting for a connection of the store's pool."))
	acquires, err5 := m.Int64ObservableCounter(MetricPoolAcquires, metric.WithUnit("{acquire}"),
		metric.WithDescription("Acquires of a connection of the store's pool."))
	acquireTime, err6 := m.Float64ObservableCounter(MetricPoolAcquireDuration, metric.WithUnit("s"),
		metric.WithDescription("Time the acquires of a connection of the store's pool took in all, waits included."))
	canceled, err7 := m.Int64ObservableCounter(MetricPoolCanceledAcquires, metric.WithUnit("{acquire}"),
		metric.WithDescription("Acquires of a connection given up because the call's context ended."))
	opened, err8 := m.Int64ObservableCounter(MetricPoolOpened, metric.WithUnit("{connection}"),
		metric.WithDescription("Connections the store's pool opened."))
	if err := errors.Join(err1, err2, err3, err4, err5, err6, err7, err8); err != nil {
		return nil, err
	}
	acquired := metric.WithAttributes(attribute.String("state", "acquired"))
	idle := metric.WithAttributes(attribute.String("state", "idle"))
	constructing := metric.WithAttributes(attribute.String("state", "constructing"))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		st := s.pool.Stat()
		o.ObserveInt64(conns, int64(st.AcquiredConns()), acquired)
		o.ObserveInt64(conns, int64(st.IdleConns()), idle)
		o.ObserveInt64(conns, int64(st.ConstructingConns()), constructing)
		o.ObserveInt64(maxConns, int64(st.MaxConns()))
		o.ObserveInt64(empty, st.EmptyAcquireCount())
		o.ObserveFloat64(wait, st.EmptyAcquireWaitTime().Seconds())
		o.ObserveInt64(acquires, st.AcquireCount())
		o.ObserveFloat64(acquireTime, st.AcquireDuration().Seconds())
		o.ObserveInt64(canceled, st.CanceledAcquireCount())
		o.ObserveInt64(opened, st.NewConnsCount())
		return nil
	}, conns, maxConns, empty, wait, acquires, acquireTime, canceled, opened)
}
