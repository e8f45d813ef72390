package server

import (
	"context"

	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Bounds of a batch; a batch over them is refused as a whole, by the
// interceptors, before any item is looked at (batchBounds). Within bounds,
// the interceptors leave a verdict per item in the context (itemVerdicts)
// for the handlers (batch.go) to answer that item with.
const (
	MaxBatchItems = 500
	MaxBatchBytes = 4 << 20
)

// batchBounds refuses a batch over the bounds, before anything else is
// looked at: items of a refused batch consume no rate limit.
func batchBounds(req proto.Message, items int) error {
	var v violations
	switch {
	case items == 0:
		v.add("requests", "required: at least one request")
	case items > MaxBatchItems:
		v.add("requests", "must hold at most %d requests, got %d", MaxBatchItems, items)
	}
	if n := proto.Size(req); n > MaxBatchBytes {
		v.add("requests", "must be at most %d bytes in all, got %d", MaxBatchBytes, n)
	}
	return v.err()
}

// batchConsumers returns the consumers of a batch request's items, and
// false for a request that is not a batch.
func batchConsumers(req any) ([]string, bool) {
	switch r := req.(type) {
	case *idemregv1.BatchClaimRequest:
		out := make([]string, len(r.GetRequests()))
		for i, item := range r.GetRequests() {
			out[i] = item.GetConsumer()
		}
		return out, true
	case *idemregv1.BatchCompleteRequest:
		out := make([]string, len(r.GetRequests()))
		for i, item := range r.GetRequests() {
			out[i] = item.GetConsumer()
		}
		return out, true
	}
	return nil, false
}

// itemVerdicts are the refusals of a batch's items by the interceptors,
// one per item, nil for an item they let through.
type itemVerdicts []error

type verdictsKey struct{}

// verdictsFor returns the verdicts of ctx's batch, creating them for n
// items when no interceptor has yet; the second result is the context to
// pass on.
func verdictsFor(ctx context.Context, n int) (itemVerdicts, context.Context) {
	if v, ok := ctx.Value(verdictsKey{}).(itemVerdicts); ok && len(v) == n {
		return v, ctx
	}
	v := make(itemVerdicts, n)
	return v, context.WithValue(ctx, verdictsKey{}, v)
}

func verdictsOf(ctx context.Context, n int) itemVerdicts {
	if v, ok := ctx.Value(verdictsKey{}).(itemVerdicts); ok && len(v) == n {
		return v
	}
	return make(itemVerdicts, n)
}
