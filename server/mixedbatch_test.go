package server_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/storage"
)

func claimItem(r *idemregv1.ClaimRequest) *idemregv1.BatchItem {
	return &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: r}}
}

func completeItem(r *idemregv1.CompleteRequest) *idemregv1.BatchItem {
	return &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Complete{Complete: r}}
}

// completeOf is the Complete of cl's claim of key with result.
func completeOf(cl *idemregv1.ClaimResponse, key, result string) *idemregv1.CompleteRequest {
	r := claimReq(key, "")
	return &idemregv1.CompleteRequest{Consumer: r.Consumer, Kind: r.Kind, Key: key,
		Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response(result)}
}

// itemClaim is one Batch claim item's answer as a unary answer; it fails
// the test when the item was answered as a complete.
func itemClaim(t *testing.T, r *idemregv1.BatchItemResult) (*idemregv1.ClaimResponse, error) {
	t.Helper()
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	require.NotNil(t, r.GetClaim(), "a claim item answered %v", r)
	return r.GetClaim(), nil
}

func itemComplete(t *testing.T, r *idemregv1.BatchItemResult) (*idemregv1.CompleteResponse, error) {
	t.Helper()
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	require.NotNil(t, r.GetComplete(), "a complete item answered %v", r)
	return r.GetComplete(), nil
}

// sameCompleteAnswer checks that a complete item answered what its unary
// twin did.
func sameCompleteAnswer(t *testing.T, unary, batch *idemregv1.CompleteResponse, uerr, berr error) {
	t.Helper()
	if uerr != nil {
		require.Error(t, berr, "the unary call failed: %v", uerr)
		us, bs := status.Convert(uerr), status.Convert(berr)
		require.Equal(t, us.Code(), bs.Code())
		require.Equal(t, len(us.Details()), len(bs.Details()))
		require.Equal(t, violatedFields(us), violatedFields(bs))
		return
	}
	require.NoError(t, berr)
	require.Equal(t, unary.GetRecord().GetState(), batch.GetRecord().GetState())
	require.Equal(t, unary.GetRecord().GetAttempt(), batch.GetRecord().GetAttempt())
	require.Equal(t, unary.GetRecord().GetToken() != 0, batch.GetRecord().GetToken() != 0)
	require.Equal(t, unary.GetRecord().GetResult().GetResponse().GetData(), batch.GetRecord().GetResult().GetResponse().GetData())
}

// TestBatchAnswersLikeUnary sets up two identical sets of keys, one
// answered by unary Claims and Completes and one by a single Batch mixing
// them, and compares the answers item by item: every row of the Claim
// table, and Completes that store, lose their lease, carry a forged secret
// or an invalid result.
func TestBatchAnswersLikeUnary(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		type pair struct {
			claim    *idemregv1.ClaimRequest
			complete *idemregv1.CompleteRequest
		}
		setup := func(prefix string) []pair {
			busy, done, other := claimReq(prefix+"busy", "fp"), claimReq(prefix+"done", "fp"), claimReq(prefix+"other", "fp")
			for _, r := range []*idemregv1.ClaimRequest{busy, done, other} {
				_, err := c.Claim(ctx, r)
				require.NoError(t, err)
			}
			d, err := c.Claim(ctx, claimReq(prefix+"done-2", "fp"))
			require.NoError(t, err)
			_, err = c.Complete(ctx, completeOf(d, prefix+"done-2", "stored"))
			require.NoError(t, err)
			held, err := c.Claim(ctx, claimReq(prefix+"held", "fp"))
			require.NoError(t, err)
			// stale: its first holder's lease ran out and another took it.
			staleReq := claimReq(prefix+"stale", "fp")
			staleReq.Lease = durationpb.New(time.Second)
			stale, err := c.Claim(ctx, staleReq)
			require.NoError(t, err)
			h.clock.Advance(2 * time.Second)
			_, err = c.Claim(ctx, claimReq(prefix+"stale", "fp"))
			require.NoError(t, err)
			badResult := completeOf(held, prefix+"held", "")
			badResult.Result = nil

			mismatch := claimReq(prefix+"other", "another")
			bad := claimReq(strings.Repeat("k", 300), "")
			badLease := claimReq(prefix+"bad-lease", "")
			badLease.Lease = durationpb.New(-time.Second)
			forgedReq := completeOf(held, prefix+"held", "intruder")
			forgedReq.ClaimSecret = forged
			return []pair{
				{claim: claimReq(prefix+"new", "fp")},                 // acquired
				{complete: badResult},                                 // invalid result
				{claim: claimReq(prefix+"busy", "fp")},                // in progress
				{complete: forgedReq},                                 // claim secret invalid
				{claim: claimReq(prefix+"done-2", "fp")},              // replay
				{complete: completeOf(stale, prefix+"stale", "late")}, // lease lost
				{claim: mismatch}, {claim: bad}, {claim: badLease},
				{complete: completeOf(held, prefix+"held", "r")}, // stored
			}
		}
		unary, batched := setup("u-"), setup("b-")
		req := &idemregv1.BatchRequest{}
		for _, p := range batched {
			if p.claim != nil {
				req.Items = append(req.Items, claimItem(p.claim))
			} else {
				req.Items = append(req.Items, completeItem(p.complete))
			}
		}
		batch, err := c.Batch(ctx, req)
		require.NoError(t, err)
		require.Len(t, batch.GetResults(), len(batched))
		for i, p := range unary {
			t.Run(fmt.Sprint(i), func(t *testing.T) {
				if p.claim != nil {
					ures, uerr := c.Claim(ctx, p.claim)
					bres, berr := itemClaim(t, batch.GetResults()[i])
					sameAnswer(t, ures, bres, uerr, berr)
					return
				}
				ures, uerr := c.Complete(ctx, p.complete)
				bres, berr := itemComplete(t, batch.GetResults()[i])
				sameCompleteAnswer(t, ures, bres, uerr, berr)
			})
		}
		_, err = itemComplete(t, batch.GetResults()[5])
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
		_, err = itemClaim(t, batch.GetResults()[6])
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)

		// The batch's claims are real: the acquired one completes.
		acquired, err := itemClaim(t, batch.GetResults()[0])
		require.NoError(t, err)
		_, err = c.Complete(ctx, completeOf(acquired, "b-new", "done"))
		require.NoError(t, err)
	})
}

// TestBatchCompleteThenClaim: a Complete and then a Claim of one key in
// one Batch keep their order: the Claim replays what the Complete stored;
// and a Claim with a wait of a key the batch names twice answers at once.
func TestBatchCompleteThenClaim(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		held, err := c.Claim(ctx, claimReq("k", "fp"))
		require.NoError(t, err)
		res, err := c.Batch(ctx, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
			completeItem(completeOf(held, "k", "stored")),
			claimItem(claimReq("k", "fp")),
		}})
		require.NoError(t, err)
		done, err := itemComplete(t, res.GetResults()[0])
		require.NoError(t, err)
		require.Equal(t, idemregv1.State_STATE_COMPLETED, done.GetRecord().GetState())
		replay, err := itemClaim(t, res.GetResults()[1])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome(), "the Claim is decided after the Complete")
		require.Equal(t, "stored", string(replay.GetRecord().GetResult().GetResponse().GetData()))

		// A Claim, then a Complete of another key, then a second Claim of
		// the first: the second sees the first's holder.
		busy, err := c.Claim(ctx, claimReq("busy", "fp"))
		require.NoError(t, err)
		wait := claimReq("busy", "fp")
		wait.Wait = durationpb.New(20 * time.Second)
		wait.Holder = "waiter"
		forgedDone := completeOf(busy, "busy", "intruder")
		forgedDone.ClaimSecret = forged
		res, err = c.Batch(ctx, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
			completeItem(forgedDone), // names busy: the Claim below does not wait
			claimItem(wait),
		}})
		require.NoError(t, err)
		_, err = itemComplete(t, res.GetResults()[0])
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		inProgress, err := itemClaim(t, res.GetResults()[1])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, inProgress.GetOutcome(), "answered at once")
	})
}

// TestBatchWaits: a Batch's Claim with a wait waits like a Claim, while
// its other items are decided; a Complete in another Batch wakes it.
func TestBatchWaits(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		holder, err := h.c.Claim(t.Context(), claimReq("busy", "fp"))
		require.NoError(t, err)
		other, err := h.c.Claim(t.Context(), claimReq("other", "fp"))
		require.NoError(t, err)
		got := make(chan *idemregv1.BatchResponse, 1)
		go func() {
			res, err := h.c.Batch(t.Context(), &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
				claimItem(claimReq("fresh", "")), claimItem(waiting("busy", 20*time.Second)),
				completeItem(completeOf(other, "other", "o")),
			}})
			require.NoError(t, err)
			got <- res
		}()
		h.waitersReach(t, 1)
		// The batch's Complete is stored before its Claim is woken.
		looked, err := h.c.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "other"})
		require.NoError(t, err)
		require.Equal(t, idemregv1.State_STATE_COMPLETED, looked.GetRecord().GetState())
		woke, err := h.c.Batch(t.Context(), &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{completeItem(completeOf(holder, "busy", "done"))}})
		require.NoError(t, err)
		_, err = itemComplete(t, woke.GetResults()[0])
		require.NoError(t, err)
		res := <-got
		fresh, err := itemClaim(t, res.GetResults()[0])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, fresh.GetOutcome())
		busy, err := itemClaim(t, res.GetResults()[1])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, busy.GetOutcome())
		require.Equal(t, "done", string(busy.GetRecord().GetResult().GetResponse().GetData()))
		_, err = itemComplete(t, res.GetResults()[2])
		require.NoError(t, err)
	})
}

// TestBatchItemsRefusedEach: a Batch mixing an item the caller may not
// use, items over their consumer's rate limit, an invalid item and an item
// that is neither a claim nor a complete: each refused item gets its unary
// call's status (the last INVALID_ARGUMENT on items[i], not
// PERMISSION_DENIED for its empty consumer), the others their answers.
func TestBatchItemsRefusedEach(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
  - {name: other, token_hashes: ["`+access.HashToken("other-token")+`"], consumers: ["other.*"]}
rate_limits:
  - consumers: ["team.limited"]
    rate: 0.001
    burst: 2
`)
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src}))
	ctx := bearer(t.Context(), "team-token")
	claim := func(consumer, key string) *idemregv1.ClaimRequest {
		return &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key}
	}
	held, err := c.Claim(ctx, claim("team.a", "held"))
	require.NoError(t, err)
	res, err := c.Batch(ctx, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
		claimItem(claim("team.a", "k1")),
		claimItem(claim("other.a", "k1")), // not this identity's
		{},                                // neither a claim nor a complete
		claimItem(claim("team.limited", "k1")),
		completeItem(&idemregv1.CompleteRequest{Consumer: "team.limited", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k1",
			Token: 1, ClaimSecret: forged, Result: response("x")}), // the limit's second call
		claimItem(claim("team.limited", "k3")), // over the burst
		claimItem(claim("team.a", "")),         // invalid
		completeItem(&idemregv1.CompleteRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "held",
			Token: held.GetToken(), ClaimSecret: held.GetClaimSecret(), Result: response("r")}),
	}})
	require.NoError(t, err)
	got := res.GetResults()
	require.Len(t, got, 8)
	for _, i := range []int{0, 3} {
		r, err := itemClaim(t, got[i])
		require.NoError(t, err, "item %d", i)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, r.GetOutcome())
	}
	_, err = itemClaim(t, got[1])
	st := requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	require.Equal(t, `identity "team" may not use consumer "other.a"`, st.Message(), "the unary call's answer")
	require.NotNil(t, got[2].GetError())
	st = requireStatus(t, status.FromProto(got[2].GetError()).Err(), codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{"items[2]"}, violatedFields(st))
	_, err = itemComplete(t, got[4])
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
	_, err = itemClaim(t, got[5])
	requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonRateLimited)
	require.Equal(t, "consumer:team.limited", detail[*errdetails.QuotaFailure](t, err).GetViolations()[0].GetSubject())
	_, err = itemClaim(t, got[6])
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{"key"}, violatedFields(st))
	done, err := itemComplete(t, got[7])
	require.NoError(t, err)
	require.Equal(t, "r", string(done.GetRecord().GetResult().GetResponse().GetData()))

	// The refused item wrote nothing: the other team finds its key free.
	free, err := c.Claim(bearer(t.Context(), "other-token"), claim("other.a", "k1"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, free.GetOutcome())
}

// TestBatchBoundsRefusedWhole: a Batch over the bounds, or empty, is
// refused as a whole and nothing in it is decided; the largest passes.
func TestBatchBoundsRefusedWhole(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		_, err := c.Batch(ctx, &idemregv1.BatchRequest{})
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"items"}, violatedFields(st))

		many := make([]*idemregv1.BatchItem, server.MaxBatchItems+1)
		for i := range many {
			many[i] = claimItem(claimReq(fmt.Sprintf("k-%d", i), ""))
		}
		_, err = c.Batch(ctx, &idemregv1.BatchRequest{Items: many})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"items"}, violatedFields(st))
		_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k-0"})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

		// 5 results of 900 KiB beside a claim: over the total size.
		data := strings.Repeat("d", 900<<10)
		big := []*idemregv1.BatchItem{claimItem(claimReq("k-0", ""))}
		for i := range 5 {
			big = append(big, completeItem(&idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION,
				Key: fmt.Sprint(i), Token: 1, ClaimSecret: forged, Result: response(data)}))
		}
		_, err = c.Batch(ctx, &idemregv1.BatchRequest{Items: big})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"items"}, violatedFields(st))
		_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k-0"})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

		got, err := c.Batch(ctx, &idemregv1.BatchRequest{Items: many[:server.MaxBatchItems]})
		require.NoError(t, err)
		for _, r := range got.GetResults() {
			res, err := itemClaim(t, r)
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
		}
	})
}

// TestBatchRacingHolders: goroutines send Batches that claim keys of a
// small set and complete some of the claims they hold, while leases run
// out under them (the stores' clock moves). Each acquisition of a key has a token
// above every token of the key acquired before it was sent, no two
// acquisitions share a token, and a key is completed once, by the holder
// of the token its record keeps.
func TestBatchRacingHolders(t *testing.T) {
	const (
		workers = 8
		rounds  = 40
		keys    = 12
	)
	forEachBackend(t, func(t *testing.T, h *harness) {
		type acquisition struct {
			sent, answered time.Time
			token          int64
			worker         int
		}
		var (
			mu        sync.Mutex
			acquired  = map[string][]acquisition{}
			completed = map[string][]int64{} // tokens of the Completes that stored
			// Items the store could not decide in time on a loaded machine
			// (UNAVAILABLE): they may or may not have been applied, as a
			// unary call so answered, and the checks hold either way.
			unavailable atomic.Int64
		)
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(w), 36))
				held := map[string]*idemregv1.ClaimResponse{}
				for range rounds {
					req := &idemregv1.BatchRequest{}
					var order []string
					for k, cl := range held {
						if rng.IntN(6) == 0 {
							req.Items = append(req.Items, completeItem(completeOf(cl, k, fmt.Sprintf("w%d-%d", w, cl.GetToken()))))
							order = append(order, k)
						}
					}
					for range 1 + rng.IntN(4) {
						k := fmt.Sprintf("race-%d", rng.IntN(keys))
						r := claimReq(k, "fp")
						r.Lease = durationpb.New(5 * time.Second)
						r.Holder = fmt.Sprint("w", w)
						req.Items = append(req.Items, claimItem(r))
						order = append(order, k)
					}
					if rng.IntN(6) == 0 { // leases of 5 s run out
						h.clock.Advance(6 * time.Second)
					}
					sent := time.Now()
					res, err := h.client.Batch(t.Context(), req)
					if !assertNoError(t, err) {
						return
					}
					answered := time.Now()
					for i, r := range res.GetResults() {
						k := order[i]
						if c := req.Items[i].GetComplete(); c != nil {
							delete(held, k)
							switch code := codes.Code(r.GetError().GetCode()); {
							case r.GetError() == nil:
								mu.Lock()
								completed[k] = append(completed[k], c.GetToken())
								mu.Unlock()
							case code == codes.Unavailable:
								unavailable.Add(1) // ambiguous, as the unary call's would be
							case code != codes.FailedPrecondition:
								t.Errorf("complete of %s: %v", k, status.FromProto(r.GetError()).Err())
							}
							continue
						}
						if e := r.GetError(); e != nil {
							if codes.Code(e.GetCode()) == codes.Unavailable {
								unavailable.Add(1)
								continue
							}
							t.Errorf("claim of %s: %v", k, status.FromProto(e).Err())
							continue
						}
						if cl := r.GetClaim(); cl.GetOutcome() == idemregv1.Outcome_OUTCOME_ACQUIRED {
							held[k] = cl
							mu.Lock()
							acquired[k] = append(acquired[k], acquisition{sent: sent, answered: answered, token: cl.GetToken(), worker: w})
							mu.Unlock()
						}
					}
				}
			})
		}
		wg.Wait()

		total := 0
		for k, as := range acquired {
			total += len(as)
			tokens := map[int64]bool{}
			for _, a := range as {
				require.False(t, tokens[a.token], "%s: token %d acquired twice", k, a.token)
				tokens[a.token] = true
				for _, b := range as {
					if a.answered.Before(b.sent) {
						require.Less(t, a.token, b.token, "%s: an acquisition after another has a greater token", k)
					}
				}
			}
			done := completed[k]
			require.LessOrEqual(t, len(done), 1, "%s completed by %v", k, done)
			if len(done) == 1 {
				require.True(t, tokens[done[0]], "%s completed with a token no one acquired", k)
				looked, err := h.client.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: k})
				require.NoError(t, err)
				require.Equal(t, idemregv1.State_STATE_COMPLETED, looked.GetRecord().GetState())
			}
		}
		sorted := make([]string, 0, len(acquired))
		for k := range acquired {
			sorted = append(sorted, k)
		}
		sort.Strings(sorted)
		t.Logf("%d acquisitions of %d keys, %d completed, %d items unavailable", total, len(sorted), len(completed), unavailable.Load())
		require.Greater(t, total, keys, "leases ran out and keys were acquired again")
	})
}

// assertNoError reports err to t without stopping its goroutine's caller.
func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Errorf("batch: %v", err)
		return false
	}
	return true
}

// keylessStore is a store whose claim keys cannot be read.
type keylessStore struct{ storage.Store }

func (keylessStore) ClaimKeyRing(context.Context) (storage.ClaimKeyRing, error) {
	return storage.ClaimKeyRing{}, storage.ErrUnavailable
}

func (keylessStore) RotateClaimKey(context.Context, storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	return storage.ClaimKeyRing{}, storage.ErrUnavailable
}

// TestBatchWithoutClaimKeys: a server that cannot read its claim keys
// answers a Batch's items each with that error (no Claim is decided, since
// none could be proved) rather than failing the call, while BatchClaim
// fails as a whole, as before; nothing is written.
func TestBatchWithoutClaimKeys(t *testing.T) {
	c := idemregv1.NewRegistryServiceClient(start(t, keylessStore{memStore(t)}, server.Config{}))
	ctx := t.Context()
	res, err := c.Batch(ctx, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
		claimItem(claimReq("k", "fp")),
		completeItem(&idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "other",
			Token: 1, ClaimSecret: forged, Result: response("x")}),
		{},
	}})
	require.NoError(t, err)
	_, err = itemClaim(t, res.GetResults()[0])
	requireStatus(t, err, codes.Unavailable, idemregv1.ReasonStoreUnavailable)
	_, err = itemComplete(t, res.GetResults()[1])
	requireStatus(t, err, codes.Unavailable, idemregv1.ReasonStoreUnavailable)
	require.Equal(t, int32(codes.InvalidArgument), res.GetResults()[2].GetError().GetCode())

	_, err = c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{claimReq("k", "fp")}})
	requireStatus(t, err, codes.Unavailable, idemregv1.ReasonStoreUnavailable)
	_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k"})
	requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
}

// plainStore is a store with none of its optional capabilities: no
// Batcher, no MixedBatcher, so storage.Batch falls back to one call after
// the other in rounds per key.
type plainStore struct{ storage.Store }

// TestBatchOnPlainStore: on a store that batches nothing, a Batch answers
// as on one that does: a Complete then a Claim of one key keep their
// order, and a Complete whose secret does not prove its token fails alone.
func TestBatchOnPlainStore(t *testing.T) {
	c := idemregv1.NewRegistryServiceClient(start(t, plainStore{memStore(t)}, server.Config{}))
	ctx := t.Context()
	held, err := c.Claim(ctx, claimReq("k", "fp"))
	require.NoError(t, err)
	other, err := c.Claim(ctx, claimReq("other", "fp"))
	require.NoError(t, err)
	stale := completeOf(other, "other", "late")
	stale.Token = other.GetToken() - 1
	res, err := c.Batch(ctx, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
		completeItem(completeOf(held, "k", "stored")),
		claimItem(claimReq("k", "fp")),
		completeItem(stale),
		claimItem(claimReq("new", "fp")),
	}})
	require.NoError(t, err)
	_, err = itemComplete(t, res.GetResults()[0])
	require.NoError(t, err)
	replay, err := itemClaim(t, res.GetResults()[1])
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	_, err = itemComplete(t, res.GetResults()[2])
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
	fresh, err := itemClaim(t, res.GetResults()[3])
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, fresh.GetOutcome())
}
