package server

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Attributes of the call's span (otelgrpc's server span), set from what
// the access log's interceptor has at hand, and only when the span is
// recording (a sampled call): an unsampled call pays one context lookup.
// Their values are bounded: consumers are validated names (or refused),
// kinds and outcomes are enum names, reasons are the API's.
const (
	AttrConsumer = attribute.Key("idemreg.consumer")
	AttrKind     = attribute.Key("idemreg.kind")
	AttrIdentity = attribute.Key("idemreg.identity")
	// AttrOutcome is a Claim's outcome (OUTCOME_ACQUIRED, ...), OK for
	// another call that succeeded, or the error reason of a refused or
	// failed call (LEASE_LOST, RATE_LIMITED, STORE_UNAVAILABLE, ...).
	AttrOutcome = attribute.Key("idemreg.outcome")
)

// traceRequest sets the request's attributes on span.
func traceRequest(span trace.Span, req any) {
	if r, ok := req.(interface{ GetConsumer() string }); ok {
		if c := r.GetConsumer(); c != "" {
			span.SetAttributes(AttrConsumer.String(c))
		}
	}
	if r, ok := req.(interface{ GetKind() idemregv1.Kind }); ok {
		span.SetAttributes(AttrKind.String(r.GetKind().String()))
	}
}

// traceAnswer sets the call's outcome (and the caller's identity, known
// once authentication ran) on span.
func traceAnswer(span trace.Span, identity string, resp any, err error) {
	if identity != "" {
		span.SetAttributes(AttrIdentity.String(identity))
	}
	if err != nil {
		if r := errorReason(err); r != "" {
			span.SetAttributes(AttrOutcome.String(r))
		}
		return
	}
	if r, ok := resp.(interface{ GetOutcome() idemregv1.Outcome }); ok {
		span.SetAttributes(AttrOutcome.String(r.GetOutcome().String()))
		return
	}
	span.SetAttributes(AttrOutcome.String("OK"))
}

// errorReason is the google.rpc.ErrorInfo reason of a status error, empty
// for none.
func errorReason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}
