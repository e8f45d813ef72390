package client

import (
	"context"
	"errors"
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

func newClaimCoalescer(rpc idemregv1.RegistryServiceClient, b Batching) *coalescer[*idemregv1.ClaimRequest, *idemregv1.ClaimResponse] {
	return &coalescer[*idemregv1.ClaimRequest, *idemregv1.ClaimResponse]{
		cfg: b,
		one: func(ctx context.Context, req *idemregv1.ClaimRequest) (*idemregv1.ClaimResponse, error) {
			return rpc.Claim(ctx, req)
		},
		many: func(ctx context.Context, reqs []*idemregv1.ClaimRequest) ([]*idemregv1.ClaimResponse, []error) {
			res, err := rpc.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: reqs})
			return itemAnswers(res.GetResults(), err, "BatchClaim", len(reqs))
		},
		shareable: func(r *idemregv1.ClaimRequest) bool {
			return utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey()) &&
				utf8.ValidString(r.GetHolder()) && utf8.ValidString(r.GetRequestId())
		},
	}
}

func newCompleteCoalescer(rpc idemregv1.RegistryServiceClient, b Batching) *coalescer[*idemregv1.CompleteRequest, *idemregv1.CompleteResponse] {
	return &coalescer[*idemregv1.CompleteRequest, *idemregv1.CompleteResponse]{
		cfg: b,
		one: func(ctx context.Context, req *idemregv1.CompleteRequest) (*idemregv1.CompleteResponse, error) {
			return rpc.Complete(ctx, req)
		},
		many: func(ctx context.Context, reqs []*idemregv1.CompleteRequest) ([]*idemregv1.CompleteResponse, []error) {
			res, err := rpc.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: reqs})
			return itemAnswers(res.GetResults(), err, "BatchComplete", len(reqs))
		},
		shareable: func(r *idemregv1.CompleteRequest) bool {
			ok := utf8.ValidString(r.GetConsumer()) && utf8.ValidString(r.GetKey())
			if resp := r.GetResult().GetResponse(); resp != nil {
				ok = ok && utf8.ValidString(resp.GetType())
			}
			if f := r.GetResult().GetFailure(); f != nil {
				ok = ok && utf8.ValidString(f.GetMessage())
			}
			return ok
		},
	}
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
