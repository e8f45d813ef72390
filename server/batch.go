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
// BatchClaim, BatchComplete and Batch carry items that are independent:
// each is authorised and rate-limited by the interceptors (which leave a
// verdict per item in the context, itemVerdicts, instead of refusing the
// call), admitted on its own (admitClaim, admitComplete: validated, within
// memory and its consumer's quota, its claim secret checked), and its
// answer is what the unary call would have answered, errors with the same
// details (claimAnswer, completeAnswer). The items that pass go to the
// store together (decideItems): one statement or one synced write for all
// of them, and for Batch one transaction for its Claims and Completes
// alike. The three handlers differ only in how they read items and write
// results, so that an item is decided the same whichever batch carries it.
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

// batchItem is one admitted item of a batch on its way through the store:
// a Claim (claim set, op.Claim pointing at it) or a Complete.
type batchItem struct {
	i        int // its index in the request
	claim    storage.ClaimParams
	complete storage.CompleteParams
	isClaim  bool
	// A Claim's wait (0 for a key the batch names more than once), its
	// consumer's quota reservation, and, while it waits, its registration.
	wait time.Duration
	r    *quota.Reservation
	c    waiting.Claim
	j    waiting.Joined
	ans  storage.OpAnswer
}

func (it *batchItem) key() storage.Key {
	if it.isClaim {
		return it.claim.Key
	}
	return it.complete.Key
}

func (it *batchItem) op() storage.Op {
	if it.isClaim {
		return storage.Op{Claim: &it.claim}
	}
	return storage.Op{Complete: &it.complete}
}

// namedKeys counts the items of a batch on each key. A key named more than
// once does not wait: a later item on it is decided after the earlier one,
// which a wait would undo.
type namedKeys map[storage.Key]int

func (n namedKeys) add(consumer string, kind idemregv1.Kind, key string) {
	n[storage.Key{Consumer: consumer, Kind: storage.Kind(kind), Key: key}]++
}

// admitClaim is the first half of a claim item, all that its unary Claim
// does before the store: its verdict, validation, the memory guard, and its
// consumer's quota. An error is the item's answer.
func (s *Service) admitClaim(ctx context.Context, method string, i int, req *idemregv1.ClaimRequest, verdict error, named namedKeys) (batchItem, error) {
	if verdict != nil {
		return batchItem{}, verdict
	}
	p, wait, err := s.validateClaim(ctx, req)
	if err != nil {
		return batchItem{}, err
	}
	if named[p.Key] > 1 {
		wait = 0
	}
	if err := s.admission.RefuseClaim(); err != nil {
		return batchItem{}, s.toStatus(ctx, method, p.Key, err)
	}
	// Each item's quota on its own, before the store: a refused item is
	// that item's answer, as its unary Claim's would be.
	r, err := s.quotas.Admit(ctx, s.store, identityName(ctx), s.policyFor(ctx, p.Consumer), p)
	if err != nil {
		return batchItem{}, s.toStatus(ctx, method, p.Key, err)
	}
	return batchItem{i: i, claim: p, isClaim: true, wait: wait, r: r}, nil
}

// admitComplete is the first half of a complete item: its verdict,
// validation and claim secret. An error is the item's answer.
func (s *Service) admitComplete(ctx context.Context, method string, i int, req *idemregv1.CompleteRequest, verdict error) (batchItem, error) {
	if verdict != nil {
		return batchItem{}, verdict
	}
	p, err := s.validateComplete(req)
	if err != nil {
		return batchItem{}, err
	}
	if err := s.secrets.Check(ctx, p.Key, p.Token, req.GetClaimSecret()); err != nil {
		return batchItem{}, s.toStatus(ctx, method, p.Key, err)
	}
	return batchItem{i: i, complete: p}, nil
}

// decideItems decides the admitted items with one call of run, in their
// order, and settles each: a Claim's quota reservation, a Complete's quota
// usage and the Claims waiting for its key (here and on other replicas),
// before any of the batch's own Claims waits, so that a long wait does not
// hold up the wake-ups its Completes owe. Then the Claims with a wait that
// found their key in progress wait, all at once. It returns the key of the
// claim secrets of the acquired Claims; when that key cannot be read, no
// Claim is decided (none is acquired without an answer that proves it),
// each answers the error, which is returned too, and the Completes are
// decided all the same.
func (s *Service) decideItems(ctx context.Context, items []batchItem, run func(context.Context, []storage.Op) []storage.OpAnswer) ([]byte, error) {
	var (
		key    []byte
		keyErr error
	)
	for k := range items {
		if items[k].isClaim {
			issuer, err := s.secrets.Issuer(ctx)
			key, keyErr = issuer.Key, err
			break
		}
	}
	todo := make([]int, 0, len(items))
	ops := make([]storage.Op, 0, len(items))
	for k := range items {
		it := &items[k]
		if it.isClaim {
			if keyErr != nil {
				it.ans.Err = keyErr
				s.quotas.Claimed(it.r, storage.ClaimResult{}, keyErr) // gives the reservation back
				continue
			}
			if it.wait > 0 { // registered before the decision, as in claim
				it.c = s.waitingClaim(ctx, it.claim, it.wait, it.r)
				it.j = s.waiters.Join(it.c)
			}
		}
		todo, ops = append(todo, k), append(ops, it.op())
	}
	if len(ops) == 0 {
		return key, keyErr
	}
	for j, a := range run(ctx, ops) {
		it := &items[todo[j]]
		it.ans = a
		switch {
		case it.isClaim:
			s.quotas.Claimed(it.r, a.Claim, a.Err)
		case a.Err == nil:
			s.quotas.Completed(it.complete)
			s.ended(it.complete.Key, a.Record.Waiters)
		}
	}
	var wg sync.WaitGroup
	for _, k := range todo {
		if it := &items[k]; it.isClaim && it.wait > 0 {
			wg.Go(func() {
				start := time.Now()
				var o waiting.Outcome
				it.ans.Claim, it.ans.Err, o = s.waiters.Wait(ctx, it.c, it.j, it.ans.Claim, it.ans.Err)
				s.waited(ctx, it.c, start, o)
			})
		}
	}
	wg.Wait()
	return key, keyErr
}

// claimAnswer is a decided claim item's answer, as its unary Claim's.
func (s *Service) claimAnswer(ctx context.Context, method string, key []byte, it *batchItem) (*idemregv1.ClaimResponse, error) {
	return s.claimResponse(ctx, method, key, it.claim, it.ans.Claim, it.ans.Err)
}

// completeAnswer is a decided complete item's answer, as its unary
// Complete's.
func (s *Service) completeAnswer(ctx context.Context, method string, it *batchItem) (*idemregv1.CompleteResponse, error) {
	if it.ans.Err != nil {
		return nil, s.toStatus(ctx, method, it.complete.Key, it.ans.Err)
	}
	rec, err := toRecord(it.ans.Record, true)
	if err != nil {
		return nil, s.toStatus(ctx, method, it.complete.Key, err)
	}
	return &idemregv1.CompleteResponse{Record: rec}, nil
}

// Batch implements RegistryServiceServer: its Claims and Completes go to
// the store in one storage.Batch, in one transaction where the store can.
func (s *Service) Batch(ctx context.Context, req *idemregv1.BatchRequest) (*idemregv1.BatchResponse, error) {
	const method = "Batch"
	items := req.GetItems()
	if err := batchBounds(req, len(items)); err != nil {
		return nil, err
	}
	verdicts := verdictsOf(ctx, len(items))
	results := make([]*idemregv1.BatchItemResult, len(items))
	fail := func(i int, err error) {
		results[i] = &idemregv1.BatchItemResult{Result: &idemregv1.BatchItemResult_Error{Error: s.itemStatus(ctx, method, err)}}
	}
	named := make(namedKeys, len(items))
	for _, item := range items {
		switch x := item.GetItem().(type) {
		case *idemregv1.BatchItem_Claim:
			named.add(x.Claim.GetConsumer(), x.Claim.GetKind(), x.Claim.GetKey())
		case *idemregv1.BatchItem_Complete:
			named.add(x.Complete.GetConsumer(), x.Complete.GetKind(), x.Complete.GetKey())
		}
	}
	todo := make([]batchItem, 0, len(items))
	for i, item := range items {
		var (
			it  batchItem
			err error
		)
		// The item's kind before its verdict: an item that is neither
		// names no consumer, and is told so rather than PERMISSION_DENIED.
		switch x := item.GetItem().(type) {
		case *idemregv1.BatchItem_Claim:
			it, err = s.admitClaim(ctx, method, i, x.Claim, verdicts[i], named)
		case *idemregv1.BatchItem_Complete:
			it, err = s.admitComplete(ctx, method, i, x.Complete, verdicts[i])
		default:
			err = noItem(i)
		}
		if err != nil {
			fail(i, err)
			continue
		}
		todo = append(todo, it)
	}
	key, _ := s.decideItems(ctx, todo, func(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
		return storage.Batch(ctx, s.store, ops)
	})
	for k := range todo {
		it := &todo[k]
		if it.isClaim {
			res, err := s.claimAnswer(ctx, method, key, it)
			if err != nil {
				fail(it.i, err)
				continue
			}
			results[it.i] = &idemregv1.BatchItemResult{Result: &idemregv1.BatchItemResult_Claim{Claim: res}}
			continue
		}
		res, err := s.completeAnswer(ctx, method, it)
		if err != nil {
			fail(it.i, err)
			continue
		}
		results[it.i] = &idemregv1.BatchItemResult{Result: &idemregv1.BatchItemResult_Complete{Complete: res}}
	}
	return &idemregv1.BatchResponse{Results: results}, nil
}

// BatchClaim implements RegistryServiceServer. Its items keep their own
// store operation (storage.ClaimBatch, measured as claim_batch).
func (s *Service) BatchClaim(ctx context.Context, req *idemregv1.BatchClaimRequest) (*idemregv1.BatchClaimResponse, error) {
	const method = "BatchClaim"
	items := req.GetRequests()
	if err := batchBounds(req, len(items)); err != nil {
		return nil, err
	}
	verdicts := verdictsOf(ctx, len(items))
	results := make([]*idemregv1.BatchClaimResult, len(items))
	fail := func(i int, err error) {
		results[i] = &idemregv1.BatchClaimResult{Result: &idemregv1.BatchClaimResult_Error{Error: s.itemStatus(ctx, method, err)}}
	}
	named := make(namedKeys, len(items))
	for _, item := range items {
		named.add(item.GetConsumer(), item.GetKind(), item.GetKey())
	}
	todo := make([]batchItem, 0, len(items))
	for i, item := range items {
		it, err := s.admitClaim(ctx, method, i, item, verdicts[i], named)
		if err != nil {
			fail(i, err)
			continue
		}
		todo = append(todo, it)
	}
	key, err := s.decideItems(ctx, todo, s.claimBatch)
	if err != nil {
		// The claim key could not be read: the call fails as a whole, as
		// its unary Claims would all have.
		return nil, s.toStatus(ctx, method, todo[0].claim.Key, err)
	}
	for k := range todo {
		it := &todo[k]
		res, err := s.claimAnswer(ctx, method, key, it)
		if err != nil {
			fail(it.i, err)
			continue
		}
		results[it.i] = &idemregv1.BatchClaimResult{Result: &idemregv1.BatchClaimResult_Response{Response: res}}
	}
	return &idemregv1.BatchClaimResponse{Results: results}, nil
}

// BatchComplete implements RegistryServiceServer, like BatchClaim
// (storage.CompleteBatch, measured as complete_batch).
func (s *Service) BatchComplete(ctx context.Context, req *idemregv1.BatchCompleteRequest) (*idemregv1.BatchCompleteResponse, error) {
	const method = "BatchComplete"
	items := req.GetRequests()
	if err := batchBounds(req, len(items)); err != nil {
		return nil, err
	}
	verdicts := verdictsOf(ctx, len(items))
	results := make([]*idemregv1.BatchCompleteResult, len(items))
	fail := func(i int, err error) {
		results[i] = &idemregv1.BatchCompleteResult{Result: &idemregv1.BatchCompleteResult_Error{Error: s.itemStatus(ctx, method, err)}}
	}
	todo := make([]batchItem, 0, len(items))
	for i, item := range items {
		it, err := s.admitComplete(ctx, method, i, item, verdicts[i])
		if err != nil {
			fail(i, err)
			continue
		}
		todo = append(todo, it)
	}
	_, _ = s.decideItems(ctx, todo, s.completeBatch) // no Claim: no key to read
	for k := range todo {
		it := &todo[k]
		res, err := s.completeAnswer(ctx, method, it)
		if err != nil {
			fail(it.i, err)
			continue
		}
		results[it.i] = &idemregv1.BatchCompleteResult{Result: &idemregv1.BatchCompleteResult_Response{Response: res}}
	}
	return &idemregv1.BatchCompleteResponse{Results: results}, nil
}

// claimBatch runs ops, Claims only, as the store's ClaimBatch.
func (s *Service) claimBatch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	ps := make([]storage.ClaimParams, len(ops))
	for j, o := range ops {
		ps[j] = *o.Claim
	}
	out := make([]storage.OpAnswer, len(ops))
	for j, a := range storage.ClaimBatch(ctx, s.store, ps) {
		out[j] = storage.OpAnswer{Claim: a.Result, Err: a.Err}
	}
	return out
}

// completeBatch runs ops, Completes only, as the store's CompleteBatch.
func (s *Service) completeBatch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	ps := make([]storage.CompleteParams, len(ops))
	for j, o := range ops {
		ps[j] = *o.Complete
	}
	out := make([]storage.OpAnswer, len(ops))
	for j, a := range storage.CompleteBatch(ctx, s.store, ps) {
		out[j] = storage.OpAnswer{Record: a.Record, Err: a.Err}
	}
	return out
}
