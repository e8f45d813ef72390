package server

import (
	"context"
	"sync"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/internal/waiting"
	"github.com/idemreg/idemreg/storage"
)

// Batches.
//
// BatchClaim and BatchComplete carry items that are independent: each is
// authorised and rate-limited by the interceptors (which leave a verdict per
// item in the context, itemVerdicts, instead of refusing the call),
// validated, and decided on its own, and its answer is what the unary call
// would have answered, errors with the same details. The items that pass go
// to the store together (storage.Batcher): one statement or one synced
// write for all of them.
//
// statusOf is an item's error as the unary call would have returned it.
func statusOf(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.Convert(reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil))
}

// itemStatus is an item's error as its answer carries it. A batch's answer
// is one message, and one item's status that does not encode (a string
// field of invalid UTF-8) would fail all of it: the caller would be told
// INTERNAL for items the store had committed, without their tokens or
// records. reason.Status bounds and escapes what it quotes; this is the net
// for a status it did not build: that item alone is INTERNAL.
func (s *Service) itemStatus(ctx context.Context, method string, err error) *spb.Status {
	p := statusOf(err).Proto()
	if _, merr := proto.Marshal(p); merr != nil {
		s.logger.ErrorContext(ctx, "batch item status does not encode", "method", method, "code", codeName(codes.Code(p.GetCode())), "error", merr)
		return statusOf(reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)).Proto()
	}
	return p
}

// BatchClaim implements RegistryServiceServer.
func (s *Service) BatchClaim(ctx context.Context, req *idemregv1.BatchClaimRequest) (*idemregv1.BatchClaimResponse, error) {
	items := req.GetRequests()
	if err := batchBounds(req, len(items)); err != nil {
		return nil, err
	}
	verdicts := verdictsOf(ctx, len(items))
	results := make([]*idemregv1.BatchClaimResult, len(items))
	fail := func(i int, err error) {
		results[i] = &idemregv1.BatchClaimResult{Result: &idemregv1.BatchClaimResult_Error{Error: s.itemStatus(ctx, "BatchClaim", err)}}
	}
	type pending struct {
		i    int
		p    storage.ClaimParams
		wait time.Duration
		r    *quota.Reservation
		c    waiting.Claim
		j    waiting.Joined
		res  storage.ClaimResult
		err  error
	}
	var todo []*pending
	// A key named more than once does not wait: a later item on it is
	// decided after the earlier one, which a wait would undo.
	named := make(map[storage.Key]int, len(items))
	for _, item := range items {
		named[storage.Key{Consumer: item.GetConsumer(), Kind: storage.Kind(item.GetKind()), Key: item.GetKey()}]++
	}
	for i, item := range items {
		if verdicts[i] != nil {
			fail(i, verdicts[i])
			continue
		}
		p, wait, err := s.validateClaim(ctx, item)
		if err != nil {
			fail(i, err)
			continue
		}
		if named[p.Key] > 1 {
			wait = 0
		}
		if err := s.memory.refuse(); err != nil {
			fail(i, s.toStatus(ctx, "BatchClaim", p.Key, err))
			continue
		}
		// Each item's quota on its own, before the store: a refused item
		// is that item's answer, as its unary Claim's would be.
		r, err := s.quotas.Admit(ctx, s.store, identityName(ctx), s.policyFor(ctx, p.Consumer), p)
		if err != nil {
			fail(i, s.toStatus(ctx, "BatchClaim", p.Key, err))
			continue
		}
		todo = append(todo, &pending{i: i, p: p, wait: wait, r: r})
	}
	if len(todo) > 0 {
		key, err := s.secrets.Issuer(ctx)
		if err != nil {
			for _, t := range todo {
				s.quotas.Claimed(t.r, storage.ClaimResult{}, err) // gives the reservation back
			}
			return nil, s.toStatus(ctx, "BatchClaim", todo[0].p.Key, err)
		}
		ps := make([]storage.ClaimParams, len(todo))
		for j, t := range todo {
			ps[j] = t.p
			if t.wait > 0 { // registered before the decision, as in claim
				t.c = s.waitingClaim(ctx, t.p, t.wait, t.r)
				t.j = s.waiters.Join(t.c)
			}
		}
		for j, a := range storage.ClaimBatch(ctx, s.store, ps) {
			todo[j].res, todo[j].err = a.Result, a.Err
			s.quotas.Claimed(todo[j].r, a.Result, a.Err)
		}
		var wg sync.WaitGroup
		for _, t := range todo {
			if t.wait > 0 {
				wg.Go(func() {
					start := time.Now()
					var o waiting.Outcome
					t.res, t.err, o = s.waiters.Wait(ctx, t.c, t.j, t.res, t.err)
					s.waited(ctx, t.c, start, o)
				})
			}
		}
		wg.Wait()
		for _, t := range todo {
			res, err := s.claimResponse(ctx, "BatchClaim", key.Key, t.p, t.res, t.err)
			if err != nil {
				fail(t.i, err)
				continue
			}
			results[t.i] = &idemregv1.BatchClaimResult{Result: &idemregv1.BatchClaimResult_Response{Response: res}}
		}
	}
	return &idemregv1.BatchClaimResponse{Results: results}, nil
}

// BatchComplete implements RegistryServiceServer.
func (s *Service) BatchComplete(ctx context.Context, req *idemregv1.BatchCompleteRequest) (*idemregv1.BatchCompleteResponse, error) {
	items := req.GetRequests()
	if err := batchBounds(req, len(items)); err != nil {
		return nil, err
	}
	verdicts := verdictsOf(ctx, len(items))
	results := make([]*idemregv1.BatchCompleteResult, len(items))
	fail := func(i int, err error) {
		results[i] = &idemregv1.BatchCompleteResult{Result: &idemregv1.BatchCompleteResult_Error{Error: s.itemStatus(ctx, "BatchComplete", err)}}
	}
	var (
		idx []int
		ps  []storage.CompleteParams
	)
	for i, item := range items {
		if verdicts[i] != nil {
			fail(i, verdicts[i])
			continue
		}
		p, err := s.validateComplete(item)
		if err != nil {
			fail(i, err)
			continue
		}
		if err := s.secrets.Check(ctx, p.Key, p.Token, item.GetClaimSecret()); err != nil {
			fail(i, s.toStatus(ctx, "BatchComplete", p.Key, err))
			continue
		}
		idx, ps = append(idx, i), append(ps, p)
	}
	for j, a := range storage.CompleteBatch(ctx, s.store, ps) {
		i, p := idx[j], ps[j]
		if a.Err != nil {
			fail(i, s.toStatus(ctx, "BatchComplete", p.Key, a.Err))
			continue
		}
		s.quotas.Completed(p)
		s.ended(p.Key, a.Record.Waiters)
		rec, err := toRecord(a.Record, true)
		if err != nil {
			fail(i, s.toStatus(ctx, "BatchComplete", p.Key, err))
			continue
		}
		results[i] = &idemregv1.BatchCompleteResult{Result: &idemregv1.BatchCompleteResult_Response{Response: &idemregv1.CompleteResponse{Record: rec}}}
	}
	return &idemregv1.BatchCompleteResponse{Results: results}, nil
}
