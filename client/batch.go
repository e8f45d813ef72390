package client

import (
	"context"
	"errors"
	"sync"
	"time"
	"unicode/utf8"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// The registry's limits on one BatchClaim or BatchComplete. BatchClaim and
// BatchComplete split their items into calls within them.
const (
	MaxBatchItems = 500
	MaxBatchBytes = 4 << 20
)

// BatchClaimResult is the answer to one item of BatchClaim: the Claim, or
// the error Claim would have returned for it.
type BatchClaimResult struct {
	Claim Claim
	Err   error
}

// CompleteParams are the arguments of one Complete of BatchComplete.
type CompleteParams struct {
	Key
	Fence  Fence
	Result Result
}

// BatchCompleteResult is the answer to one item of BatchComplete: the
// stored record, or the error Complete would have returned for it.
type BatchCompleteResult struct {
	Record Record
	Err    error
}

// BatchClaim claims every item as Claim would, in order: one result per
// item, its error typed as Claim's (ErrFingerprintMismatch,
// ErrInvalidArgument, ...). A key given twice is decided twice, the second
// time after the first (so it finds the first's claim). Items go in calls
// of at most MaxBatchItems and MaxBatchBytes. When a call fails as a whole
// (the registry unreachable, the deadline), the error is returned and is
// also the Err of each item of that call and of the calls not made.
func (c *Client) BatchClaim(ctx context.Context, ps []ClaimParams) ([]BatchClaimResult, error) {
	reqs := make([]*idemregv1.ClaimRequest, len(ps))
	for i, p := range ps {
		holder := p.Holder
		if holder == "" {
			holder = c.holder
		}
		reqs[i] = p.request(holder)
	}
	out := make([]BatchClaimResult, len(ps))
	var callErr error
	for _, ch := range chunks(reqs) {
		if callErr == nil {
			res, err := c.rpc.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: reqs[ch.from:ch.to]})
			if err == nil && len(res.GetResults()) != ch.to-ch.from {
				err = status.Errorf(codes.Internal, "idemreg: BatchClaim answered %d results for %d requests", len(res.GetResults()), ch.to-ch.from)
			}
			if err == nil {
				for j, r := range res.GetResults() {
					if e := r.GetError(); e != nil {
						out[ch.from+j].Err = FromStatus(status.FromProto(e))
					} else {
						out[ch.from+j].Claim = claimFromProto(r.GetResponse())
					}
				}
				continue
			}
			callErr = FromError(err)
		}
		for i := ch.from; i < ch.to; i++ {
			out[i].Err = callErr
		}
	}
	return out, callErr
}

// BatchComplete completes every item as Complete would, in order, like
// BatchClaim.
func (c *Client) BatchComplete(ctx context.Context, ps []CompleteParams) ([]BatchCompleteResult, error) {
	reqs := make([]*idemregv1.CompleteRequest, len(ps))
	for i, p := range ps {
		consumer, kind, key := p.Key.proto()
		reqs[i] = &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: p.Fence.Token, ClaimSecret: p.Fence.Secret, Result: p.Result.proto()}
	}
	out := make([]BatchCompleteResult, len(ps))
	var callErr error
	for _, ch := range chunks(reqs) {
		if callErr == nil {
			res, err := c.rpc.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: reqs[ch.from:ch.to]})
			if err == nil && len(res.GetResults()) != ch.to-ch.from {
				err = status.Errorf(codes.Internal, "idemreg: BatchComplete answered %d results for %d requests", len(res.GetResults()), ch.to-ch.from)
			}
			if err == nil {
				for j, r := range res.GetResults() {
					if e := r.GetError(); e != nil {
						out[ch.from+j].Err = FromStatus(status.FromProto(e))
					} else {
						out[ch.from+j].Record = recordFromProto(r.GetResponse().GetRecord())
					}
				}
				continue
			}
			callErr = FromError(err)
		}
		for i := ch.from; i < ch.to; i++ {
			out[i].Err = callErr
		}
	}
	return out, callErr
}

type span struct{ from, to int }

// chunks splits items into runs within the registry's batch limits. An
// item larger than MaxBatchBytes on its own goes alone, for the registry
// to refuse with its own error.
func chunks[M proto.Message](items []M) []span {
	var out []span
	from, size := 0, 0
	for i, m := range items {
		n := proto.Size(m)
		n += protowire.SizeTag(1) + protowire.SizeVarint(uint64(n))
		if i > from && (i-from == MaxBatchItems || size+n > MaxBatchBytes) {
			out = append(out, span{from, i})
			from, size = i, 0
		}
		size += n
	}
	if from < len(items) {
		out = append(out, span{from, len(items)})
	}
	return out
}

// claimBatch is BatchClaim made the way claim makes a Claim: the whole call
// outlives ctx (bounded by the bookkeeping timeout plus the wait asked
// for), and is repeated with the same request ids when its answer was lost,
// so the claims it acquired come back instead of being stranded.
func (c *Client) claimBatch(ctx context.Context, ps []ClaimParams, wait time.Duration, s *settings) []BatchClaimResult {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.bookkeepingTimeout+wait)
	defer cancel()
	dctx = registryContext(dctx)
	delay := DefaultBackoff.Initial
	for repeats := 0; ; repeats++ {
		rs, err := c.BatchClaim(dctx, ps)
		if err == nil || repeats == claimRepeats || dctx.Err() != nil ||
			!(errors.Is(err, ErrUnavailable) || errors.Is(err, ErrDeadlineExceeded)) {
			return rs
		}
		if !sleepCtx(dctx, retryWait(delay, err)) {
			return rs
		}
		delay = min(2*delay, DefaultBackoff.Max)
	}
}

// claimShareable says whether a Claim may share an RPC: one whose strings
// are not UTF-8 would not encode, and must fail alone.
func claimShareable(r *idemregv1.ClaimRequest) bool {
	return utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey()) &&
		utf8.ValidString(r.GetHolder()) && utf8.ValidString(r.GetRequestId())
}

// completeShareable is claimShareable for a Complete.
func completeShareable(r *idemregv1.CompleteRequest) bool {
	ok := utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey())
	if resp := r.GetResult().GetResponse(); resp != nil {
		ok = ok && utf8.ValidString(resp.GetType())
	}
	if f := r.GetResult().GetFailure(); f != nil {
		ok = ok && utf8.ValidString(f.GetMessage())
	}
	return ok
}

// one sends a Claim or a Complete as its unary RPC.
func (c *coalescer) one(ctx context.Context, req proto.Message) (proto.Message, error) {
	switch r := req.(type) {
	case *idemregv1.ClaimRequest:
		return c.rpc.Claim(ctx, r)
	case *idemregv1.CompleteRequest:
		return c.rpc.Complete(ctx, r)
	}
	return nil, status.Errorf(codes.Internal, "idemreg: cannot send a %T", req)
}

// many sends several Claims and Completes in one RPC and answers each: its
// response, or its error (every item's, when the RPC failed as a whole).
func (c *coalescer) many(ctx context.Context, reqs []proto.Message) ([]proto.Message, []error) {
	if len(reqs) == 1 {
		res, err := c.one(ctx, reqs[0])
		return []proto.Message{res}, []error{err}
	}
	if !c.noBatch.Load() {
		if res, errs, ok := c.batch(ctx, reqs); ok {
			return res, errs
		}
		c.noBatch.Store(true)
	}
	return c.byKind(ctx, reqs)
}

// batch sends reqs as one Batch; ok is false when the registry does not
// know the RPC (UNIMPLEMENTED), and nothing was decided.
func (c *coalescer) batch(ctx context.Context, reqs []proto.Message) (res []proto.Message, errs []error, ok bool) {
	items := make([]*idemregv1.BatchItem, len(reqs))
	for i, r := range reqs {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			items[i] = &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: r}}
		case *idemregv1.CompleteRequest:
			items[i] = &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Complete{Complete: r}}
		}
	}
	resp, err := c.rpc.Batch(ctx, &idemregv1.BatchRequest{Items: items})
	if status.Code(err) == codes.Unimplemented {
		return nil, nil, false
	}
	results := resp.GetResults()
	if err == nil && len(results) != len(reqs) {
		err = status.Errorf(codes.Internal, "idemreg: Batch answered %d results for %d items", len(results), len(reqs))
	}
	res, errs = make([]proto.Message, len(reqs)), make([]error, len(reqs))
	for i, req := range reqs {
		if err != nil {
			errs[i] = err
			continue
		}
		switch r := results[i].GetResult().(type) {
		case *idemregv1.BatchItemResult_Error:
			errs[i] = status.FromProto(r.Error).Err()
			continue
		case *idemregv1.BatchItemResult_Claim:
			if _, ok := req.(*idemregv1.ClaimRequest); ok {
				res[i] = r.Claim
				continue
			}
		case *idemregv1.BatchItemResult_Complete:
			if _, ok := req.(*idemregv1.CompleteRequest); ok {
				res[i] = r.Complete
				continue
			}
		}
		errs[i] = status.Errorf(codes.Internal, "idemreg: Batch answered item %d (%T) with %T", i, req, results[i].GetResult())
	}
	return res, errs, true
}

// byKind sends reqs to a registry without Batch: the Claims in a
// BatchClaim and the Completes in a BatchComplete, side by side. A key
// that comes again with the other kind starts a new round, sent after the
// one before has been answered, so that each key's items are decided in
// their order, as Batch decides them.
func (c *coalescer) byKind(ctx context.Context, reqs []proto.Message) ([]proto.Message, []error) {
	res, errs := make([]proto.Message, len(reqs)), make([]error, len(reqs))
	type itemKey struct {
		consumer string
		kind     idemregv1.Kind
		key      string
		claim    bool
	}
	keyOf := func(r proto.Message) itemKey {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			return itemKey{r.GetConsumer(), r.GetKind(), r.GetKey(), true}
		case *idemregv1.CompleteRequest:
			return itemKey{r.GetConsumer(), r.GetKind(), r.GetKey(), false}
		}
		return itemKey{}
	}
	seen := map[itemKey]bool{}
	from := 0
	for i := 0; i <= len(reqs); i++ {
		if i < len(reqs) {
			k := keyOf(reqs[i])
			other := k
			other.claim = !k.claim
			if !seen[other] {
				seen[k] = true
				continue
			}
			clear(seen)
			seen[k] = true
		}
		c.round(ctx, reqs[from:i], res[from:i], errs[from:i])
		from = i
	}
	return res, errs
}

// round sends the Claims and the Completes of reqs at once, each kind in
// one RPC (its unary one for a single item), and answers into res and errs.
func (c *coalescer) round(ctx context.Context, reqs []proto.Message, res []proto.Message, errs []error) {
	var claims []*idemregv1.ClaimRequest
	var completes []*idemregv1.CompleteRequest
	var claimAt, completeAt []int
	for i, r := range reqs {
		switch r := r.(type) {
		case *idemregv1.ClaimRequest:
			claims, claimAt = append(claims, r), append(claimAt, i)
		case *idemregv1.CompleteRequest:
			completes, completeAt = append(completes, r), append(completeAt, i)
		}
	}
	var wg sync.WaitGroup
	if len(completes) > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if len(completes) == 1 {
				res[completeAt[0]], errs[completeAt[0]] = c.one(ctx, completes[0])
				return
			}
			r, err := c.rpc.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: completes})
			rs, es := itemAnswers(r.GetResults(), err, "BatchComplete", len(completes))
			for j, i := range completeAt {
				res[i], errs[i] = rs[j], es[j]
			}
		}()
	}
	if len(claims) == 1 {
		res[claimAt[0]], errs[claimAt[0]] = c.one(ctx, claims[0])
	} else if len(claims) > 1 {
		r, err := c.rpc.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: claims})
		rs, es := itemAnswers(r.GetResults(), err, "BatchClaim", len(claims))
		for j, i := range claimAt {
			res[i], errs[i] = rs[j], es[j]
		}
	}
	wg.Wait()
}

// itemResult is a batch RPC's answer to one item: BatchClaimResult or
// BatchCompleteResult.
type itemResult[Res any] interface {
	GetError() *spb.Status
	GetResponse() Res
}

// itemAnswers splits a batch RPC's answer into each of n items' response
// or error: the RPC's own error for every item when it failed, or did not
// answer each item once.
func itemAnswers[Res any, R itemResult[Res]](results []R, err error, method string, n int) ([]Res, []error) {
	if err == nil && len(results) != n {
		err = status.Errorf(codes.Internal, "idemreg: %s answered %d results for %d requests", method, len(results), n)
	}
	out, errs := make([]Res, n), make([]error, n)
	for i := range n {
		switch {
		case err != nil:
			errs[i] = err
		case results[i].GetError() != nil:
			errs[i] = status.FromProto(results[i].GetError()).Err()
		default:
			out[i] = results[i].GetResponse()
		}
	}
	return out, errs
}
