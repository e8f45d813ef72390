package main

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/server"
)

// MetricStoreConflicts counts the statements the database aborted with a
// serialization failure (40001, CR000) or a deadlock (40P01). The SQL store
// retries each of them while its retry budget and the request's deadline
// last, so this is the number of store retries (plus the last, failed
// attempt of a call whose retries ran out, which idemreg.store.errors
// counts too).
const MetricStoreConflicts = "idemreg.store.conflicts"

// conflictTracer is a pgx tracer (postgres.WithTracer) that counts them.
type conflictTracer struct{ conflicts metric.Int64Counter }

func newConflictTracer(mp metric.MeterProvider) (*conflictTracer, error) {
	c, err := mp.Meter(server.MeterName).Int64Counter(MetricStoreConflicts, metric.WithUnit("{statement}"),
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
	var pgErr *pgconn.PgError
	if !errors.As(data.Err, &pgErr) {
		return
	}
	switch pgErr.Code {
	case "40001", "40P01", "CR000":
		c.conflicts.Add(ctx, 1, metric.WithAttributes(attribute.String("sqlstate", pgErr.Code)))
	}
}
