package storechain

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemreg/idemreg/server/internal/reason"
)

// The store span: one child span of the call's per record operation,
// named "store <op>" (store claim, store complete_batch, ...), with
// db.operation.name the operation's name: the statement a backend runs
// for it is named by the operation, never written out with its values.
// An answer that is no failure (LEASE_LOST, NOT_FOUND, ...) is
// idemreg.reason on an OK span; a failure of the store sets the span's
// status to Error, with error.type (ErrorType).
//
// A span is opened only when the caller's span is recording, so that an
// untraced call (tracing off, or not sampled) pays a context lookup and
// no allocation; a record operation without a traced caller (none on the
// request path) has no span of its own.

type spanStart struct {
	name string
	opts []trace.SpanStartOption
}

func newSpanStart(op string) spanStart {
	return spanStart{name: "store " + op, opts: []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("db.operation.name", op)),
	}}
}

// startSpan opens op's store span under ctx's, nil when there is none to
// open.
func (c *Chain) startSpan(ctx context.Context, op *opMeasures) (context.Context, trace.Span) {
	if c.tracer == nil || !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, nil
	}
	return c.tracer.Start(ctx, op.span.name, op.span.opts...)
}

func endSpan(span trace.Span, err error) {
	if err != nil {
		r := reason.Classify(err)
		if reason.IsAnswer(r) {
			span.SetAttributes(attribute.String("idemreg.reason", r.Reason()))
		} else {
			t := ErrorType(r)
			span.SetAttributes(attribute.String("error.type", t))
			span.SetStatus(codes.Error, t)
		}
	}
	span.End()
}
