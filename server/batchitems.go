package server

import (
	"context"
	"fmt"

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
	field, noun := "requests", "requests"
	if _, ok := req.(*idemregv1.BatchRequest); ok {
		field, noun = "items", "items"
	}
	var v violations
	switch {
	case items == 0:
		v.add(field, "required: at least one %s", noun[:len(noun)-1])
	case items > MaxBatchItems:
		v.add(field, "must hold at most %d %s, got %d", MaxBatchItems, noun, items)
	}
	if n := proto.Size(req); n > MaxBatchBytes {
		v.add(field, "must be at most %d bytes in all, got %d", MaxBatchBytes, n)
	}
	return v.err()
}

// noItem is the answer to the i-th item of a Batch that is neither a claim
// nor a complete (one the caller's proto does not know, or none): it names
// no consumer, so it is told what is wrong with it rather than
// PERMISSION_DENIED for the empty consumer.
func noItem(i int) error {
	var v violations
	v.add(fmt.Sprintf("items[%d]", i), "must be a claim or a complete")
	return v.err()
}

// batchConsumers returns the consumers of a batch request's items, and
// false for a request that is not a batch. An item of a Batch that is
// neither a claim nor a complete has its verdict already (verdictsFor),
// and its consumer here is empty.
func batchConsumers(req any) ([]string, bool) {
	switch r := req.(type) {
	case *idemregv1.BatchRequest:
		out := make([]string, len(r.GetItems()))
		for i, item := range r.GetItems() {
			switch x := item.GetItem().(type) {
			case *idemregv1.BatchItem_Claim:
				out[i] = x.Claim.GetConsumer()
			case *idemregv1.BatchItem_Complete:
				out[i] = x.Complete.GetConsumer()
			}
		}
		return out, true
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

// verdictsFor returns the verdicts of ctx's batch req, creating them for
// its n items when no interceptor has yet; the second result is the
// context to pass on. The interceptors judge only the items without a
// verdict: an item of a Batch that is neither a claim nor a complete has
// its own from the start (noItem), and takes no rate limit.
func verdictsFor(ctx context.Context, req any, n int) (itemVerdicts, context.Context) {
	if v, ok := ctx.Value(verdictsKey{}).(itemVerdicts); ok && len(v) == n {
		return v, ctx
	}
	v := make(itemVerdicts, n)
	if b, ok := req.(*idemregv1.BatchRequest); ok {
		for i, item := range b.GetItems() {
			if !isBatchItem(item) {
				v[i] = noItem(i)
			}
		}
	}
	return v, context.WithValue(ctx, verdictsKey{}, v)
}

// isBatchItem reports whether item is a claim or a complete.
func isBatchItem(item *idemregv1.BatchItem) bool {
	switch item.GetItem().(type) {
	case *idemregv1.BatchItem_Claim, *idemregv1.BatchItem_Complete:
		return true
	}
	return false
}

func verdictsOf(ctx context.Context, n int) itemVerdicts {
	if v, ok := ctx.Value(verdictsKey{}).(itemVerdicts); ok && len(v) == n {
		return v
	}
	return make(itemVerdicts, n)
}
