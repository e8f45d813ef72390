package server_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
)

// claimResult is one BatchClaim item as a unary answer.
func claimResult(r *idemregv1.BatchClaimResult) (*idemregv1.ClaimResponse, error) {
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	return r.GetResponse(), nil
}

func completeResult(r *idemregv1.BatchCompleteResult) (*idemregv1.CompleteResponse, error) {
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	return r.GetResponse(), nil
}

// sameAnswer checks that a batch item answered what its unary twin did:
// the same outcome and record shape, or the same status with the same
// details.
func sameAnswer(t *testing.T, unary, batch *idemregv1.ClaimResponse, uerr, berr error) {
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
	require.Equal(t, unary.GetOutcome(), batch.GetOutcome())
	require.Equal(t, unary.GetRecord().GetState(), batch.GetRecord().GetState())
	require.Equal(t, unary.GetRecord().GetAttempt(), batch.GetRecord().GetAttempt())
	require.Equal(t, unary.GetToken() != 0, batch.GetToken() != 0)
	require.Equal(t, len(unary.GetClaimSecret()), len(batch.GetClaimSecret()))
	require.Equal(t, unary.GetRecord().GetToken() != 0, batch.GetRecord().GetToken() != 0, "tokens withheld alike")
	require.True(t, proto.Equal(unary.GetRecord().GetResult(), batch.GetRecord().GetResult()))
}

// TestBatchClaimAnswersLikeClaim sets up two identical sets of keys, one
// answered by unary Claims and one by a BatchClaim, and compares the
// answers item by item: every row of the Claim table, invalid items, the
// same key twice.
func TestBatchClaimAnswersLikeClaim(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		setup := func(prefix string) []*idemregv1.ClaimRequest {
			busy, done, other := claimReq(prefix+"busy", "fp"), claimReq(prefix+"done", "fp"), claimReq(prefix+"other", "fp")
			for _, r := range []*idemregv1.ClaimRequest{busy, done, other} {
				_, err := c.Claim(ctx, r)
				require.NoError(t, err)
			}
			d, err := c.Claim(ctx, claimReq(prefix+"done-2", "fp"))
			require.NoError(t, err)
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: done.Consumer, Kind: done.Kind, Key: prefix + "done-2",
				Token: d.GetToken(), ClaimSecret: d.GetClaimSecret(), Result: response("stored")})
			require.NoError(t, err)
			mismatch := claimReq(prefix+"other", "another")
			bad := claimReq(strings.Repeat("k", 300), "")
			badLease := claimReq(prefix+"bad-lease", "")
			badLease.Lease = durationpb.New(-time.Second)
			badWait := claimReq(prefix+"bad-wait", "")
			badWait.Wait = durationpb.New(time.Hour)
			return []*idemregv1.ClaimRequest{
				claimReq(prefix+"new", "fp"),    // acquired
				claimReq(prefix+"busy", "fp"),   // in progress
				claimReq(prefix+"done-2", "fp"), // replay
				mismatch, bad, badLease, badWait,
				claimReq(prefix+"twice", "fp"), claimReq(prefix+"twice", "fp"), // acquired, then in progress
			}
		}
		unaryReqs, batchReqs := setup("u-"), setup("b-")
		batch, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: batchReqs})
		require.NoError(t, err)
		require.Len(t, batch.GetResults(), len(batchReqs))
		for i, r := range unaryReqs {
			ures, uerr := c.Claim(ctx, r)
			bres, berr := claimResult(batch.GetResults()[i])
			t.Run(fmt.Sprint(i), func(t *testing.T) { sameAnswer(t, ures, bres, uerr, berr) })
		}
		first, err := claimResult(batch.GetResults()[7])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, first.GetOutcome())
		second, err := claimResult(batch.GetResults()[8])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, second.GetOutcome(), "the second sees the first's effect")

		// A batch's claims are real: complete them in a batch.
		acquired, _ := claimResult(batch.GetResults()[0])
		done, err := c.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: []*idemregv1.CompleteRequest{
			{Consumer: batchReqs[0].Consumer, Kind: batchReqs[0].Kind, Key: batchReqs[0].Key, Token: acquired.GetToken(), ClaimSecret: acquired.GetClaimSecret(), Result: response("r0")},
			{Consumer: batchReqs[7].Consumer, Kind: batchReqs[7].Kind, Key: batchReqs[7].Key, Token: first.GetToken(), ClaimSecret: forged, Result: response("intruder")},
			{Consumer: batchReqs[7].Consumer, Kind: batchReqs[7].Kind, Key: batchReqs[7].Key, Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("r7")},
			{Consumer: batchReqs[7].Consumer, Kind: batchReqs[7].Kind, Key: batchReqs[7].Key, Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("again")},
			{Consumer: batchReqs[0].Consumer, Kind: batchReqs[0].Kind, Key: "missing", Token: 5, ClaimSecret: forged, Result: response("x")},
			{Consumer: batchReqs[0].Consumer, Kind: batchReqs[0].Kind, Key: batchReqs[1].Key, Token: 1, ClaimSecret: forged},
		}})
		require.NoError(t, err)
		res := done.GetResults()
		require.Len(t, res, 6)
		r0, err := completeResult(res[0])
		require.NoError(t, err)
		require.Equal(t, "r0", string(r0.GetRecord().GetResult().GetResponse().GetData()))
		_, err = completeResult(res[1])
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		r7, err := completeResult(res[2])
		require.NoError(t, err)
		require.Equal(t, "r7", string(r7.GetRecord().GetResult().GetResponse().GetData()))
		again, err := completeResult(res[3])
		require.NoError(t, err, "the same Complete twice: the second sees the first's effect")
		require.Equal(t, "r7", string(again.GetRecord().GetResult().GetResponse().GetData()), "the first result stays")
		_, err = completeResult(res[4])
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		_, err = completeResult(res[5])
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"result"}, violatedFields(st))
		looked, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: batchReqs[1].Consumer, Kind: batchReqs[1].Kind, Key: batchReqs[1].Key})
		require.NoError(t, err)
		require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, looked.GetRecord().GetState(), "refused items change nothing")
	})
}

// TestBatchBounds: a batch over the bounds is refused as a whole.
func TestBatchBounds(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		_, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{})
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"requests"}, violatedFields(st))

		many := make([]*idemregv1.ClaimRequest, server.MaxBatchItems+1)
		for i := range many {
			many[i] = claimReq(fmt.Sprintf("k-%d", i), "")
		}
		_, err = c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: many})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"requests"}, violatedFields(st))
		_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: many[0].Consumer, Kind: many[0].Kind, Key: many[0].Key})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

		// 5 results of 900 KiB: over the total size.
		data := strings.Repeat("d", 900<<10)
		big := make([]*idemregv1.CompleteRequest, 5)
		for i := range big {
			big[i] = &idemregv1.CompleteRequest{Consumer: many[0].Consumer, Kind: many[0].Kind, Key: fmt.Sprint(i), Token: 1, ClaimSecret: forged, Result: response(data)}
		}
		_, err = c.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: big})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"requests"}, violatedFields(st))

		// The largest batch passes.
		got, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: many[:server.MaxBatchItems]})
		require.NoError(t, err)
		for _, r := range got.GetResults() {
			res, err := claimResult(r)
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
		}
	})
}

// TestBatchItemsAuthorisedAndLimitedEach: a batch mixing consumers the
// caller may use, one it may not, and more items of a limited consumer
// than its burst: the refused items get the unary call's status, the rest
// their answers, and no refused item reached the store.
func TestBatchItemsAuthorisedAndLimitedEach(t *testing.T) {
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
	item := func(consumer, key string) *idemregv1.ClaimRequest {
		return &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key}
	}
	res, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
		item("team.a", "k1"),
		item("other.a", "k1"), // not this identity's
		item("team.limited", "k1"),
		item("team.limited", "k2"),
		item("team.limited", "k3"), // over the burst
		item("team.a", ""),         // invalid
	}})
	require.NoError(t, err)
	got := res.GetResults()
	require.Len(t, got, 6)
	for _, i := range []int{0, 2, 3} {
		r, err := claimResult(got[i])
		require.NoError(t, err, "item %d", i)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, r.GetOutcome())
	}
	_, err = claimResult(got[1])
	st := requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	require.Equal(t, `identity "team" may not use consumer "other.a"`, st.Message(), "the unary call's answer")
	_, err = claimResult(got[4])
	requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonRateLimited)
	require.Equal(t, "consumer:team.limited", detail[*errdetails.QuotaFailure](t, err).GetViolations()[0].GetSubject())
	_, err = claimResult(got[5])
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{"key"}, violatedFields(st))

	// The refused item wrote nothing: the other team finds its key free.
	other, err := c.Claim(bearer(t.Context(), "other-token"), item("other.a", "k1"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, other.GetOutcome())
}
