package server_test

import (
	"encoding/base64"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// Reconciliation through the AdminService: ListRecords, ResolveRecord,
// CountParked, the attempt history and the parked records gauge, against
// a real server on both stores.

const payments = "billing.payment-worker" // claimReq's consumer

func resolveReq(key string, token int64, reason string) *idemregv1.ResolveRecordRequest {
	return &idemregv1.ResolveRecordRequest{Consumer: payments, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: token, Reason: reason}
}

func releasing(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
	r.Resolution = &idemregv1.ResolveRecordRequest_Release{Release: true}
	return r
}

func completing(r *idemregv1.ResolveRecordRequest, res *idemregv1.Result) *idemregv1.ResolveRecordRequest {
	r.Resolution = &idemregv1.ResolveRecordRequest_Result{Result: res}
	return r
}

func inspectReq(consumer, key string) *idemregv1.InspectRecordRequest {
	return &idemregv1.InspectRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key}
}

// TestResolveRecord: a record parked at max_attempts is resolved with a
// result that Claims replay; another is released and acquired as attempt
// 1, max_attempts counting afresh; InspectRecord shows the history of
// takeovers and resolutions.
func TestResolveRecord(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			clock := &storagetest.Clock{}
			conn := start(t, b.open(t, clock), server.Config{Policy: parkingPolicy(t)})
			c := idemregv1.NewRegistryServiceClient(conn)
			admin := idemregv1.NewAdminServiceClient(conn)
			ctx := t.Context()

			// parkAtMax runs key through attempts 1 and 2 to its parking.
			parkAtMax := func(key string) (first, second *idemregv1.ClaimResponse) {
				first, err := c.Claim(ctx, claimReq(key, "fp"))
				require.NoError(t, err)
				clock.Advance(11 * time.Second)
				second, err = c.Claim(ctx, claimReq(key, "fp"))
				require.NoError(t, err)
				require.EqualValues(t, 2, second.GetRecord().GetAttempt())
				clock.Advance(11 * time.Second)
				parked, err := c.Claim(ctx, claimReq(key, "fp"))
				require.NoError(t, err)
				requireParkedAnswer(t, parked, storage.ParkReasonMaxAttempts)
				return first, second
			}

			first, second := parkAtMax("pay-1")
			insp, err := admin.InspectRecord(ctx, inspectReq(payments, "pay-1"))
			require.NoError(t, err)
			require.Equal(t, second.GetToken(), insp.GetRecord().GetToken(), "the operator sees the token to resolve with")
			require.Len(t, insp.GetHistory(), 1)
			took := insp.GetHistory()[0]
			require.Equal(t, idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER, took.GetEnd())
			require.Equal(t, first.GetToken(), took.GetToken())
			require.EqualValues(t, 1, took.GetAttempt())
			require.Equal(t, "pod-a", took.GetHolder())
			require.True(t, took.GetAcquiredAt().AsTime().Equal(storage.AcquiredAt(first.GetToken())), "acquired_at read off the token")
			require.True(t, took.GetEndedAt().AsTime().Equal(first.GetRecord().GetLeaseExpiresAt().AsTime()), "ended when its lease ended")

			_, err = admin.ResolveRecord(ctx, completing(resolveReq("pay-1", first.GetToken(), "checked the provider"), response("x")))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
			_, err = admin.ResolveRecord(ctx, releasing(resolveReq("pay-none", second.GetToken(), "checked the provider")))
			requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

			done, err := admin.ResolveRecord(ctx, completing(resolveReq("pay-1", second.GetToken(), "charged once, ticket OPS-7"), response("settled by hand")))
			require.NoError(t, err)
			require.Equal(t, idemregv1.State_STATE_COMPLETED, done.GetRecord().GetState())
			require.Greater(t, done.GetRecord().GetToken(), second.GetToken(), "a fresh token nobody holds")
			require.Empty(t, done.GetRecord().GetParkReason())
			require.True(t, proto.Equal(response("settled by hand"), done.GetRecord().GetResult()))

			replay, err := c.Claim(ctx, claimReq("pay-1", "fp"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome(), "every later Claim replays the operator's result")
			require.True(t, proto.Equal(response("settled by hand"), replay.GetRecord().GetResult()))
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: payments, Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1",
				Token: second.GetToken(), ClaimSecret: second.GetClaimSecret(), Result: response("late")})
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
			_, err = admin.ResolveRecord(ctx, releasing(resolveReq("pay-1", done.GetRecord().GetToken(), "again")))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonAlreadyCompleted)

			insp, err = admin.InspectRecord(ctx, inspectReq(payments, "pay-1"))
			require.NoError(t, err)
			require.Len(t, insp.GetHistory(), 2)
			resolved := insp.GetHistory()[1]
			require.Equal(t, idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_COMPLETED, resolved.GetEnd())
			require.Equal(t, second.GetToken(), resolved.GetToken())
			require.EqualValues(t, 2, resolved.GetAttempt())
			require.Equal(t, storage.ParkReasonMaxAttempts, resolved.GetParkReason())
			require.Equal(t, "charged once, ticket OPS-7", resolved.GetNote())
			require.False(t, resolved.GetEndedAt().AsTime().Before(took.GetEndedAt().AsTime()))

			// Released: the next Claim acquires as attempt 1, and
			// max_attempts counts afresh.
			_, parkedBy := parkAtMax("pay-2")
			rel, err := admin.ResolveRecord(ctx, releasing(resolveReq("pay-2", parkedBy.GetToken(), "fixed the handler")))
			require.NoError(t, err)
			require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, rel.GetRecord().GetState())
			require.Zero(t, rel.GetRecord().GetAttempt())
			_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: payments, Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-2",
				Token: parkedBy.GetToken(), ClaimSecret: parkedBy.GetClaimSecret()})
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
			again, err := c.Claim(ctx, claimReq("pay-2", "fp"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
			require.EqualValues(t, 1, again.GetRecord().GetAttempt())
			require.Greater(t, again.GetToken(), rel.GetRecord().GetToken())
			clock.Advance(11 * time.Second)
			third, err := c.Claim(ctx, claimReq("pay-2", "fp"))
			require.NoError(t, err)
			require.EqualValues(t, 2, third.GetRecord().GetAttempt(), "max_attempts 2 counts afresh")

			insp, err = admin.InspectRecord(ctx, inspectReq(payments, "pay-2"))
			require.NoError(t, err)
			var ends []idemregv1.AttemptEnd
			for _, h := range insp.GetHistory() {
				ends = append(ends, h.GetEnd())
			}
			// The operator's fresh token was held by nobody: the Claim after
			// the release ends no attempt.
			require.Equal(t, []idemregv1.AttemptEnd{idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER, idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED,
				idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER}, ends)
			require.Equal(t, again.GetToken(), insp.GetHistory()[2].GetToken(), "the attempt after the release, taken over")
			require.Equal(t, "fixed the handler", insp.GetHistory()[1].GetNote())

			// A stuck record under a live lease can be resolved too.
			stuck, err := c.Claim(ctx, claimReq("pay-3", "fp"))
			require.NoError(t, err)
			_, err = admin.ResolveRecord(ctx, completing(resolveReq("pay-3", stuck.GetToken(), "holder gone"),
				&idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: int32(codes.Aborted), Message: "given up"}}}))
			require.NoError(t, err)
			replay, err = c.Claim(ctx, claimReq("pay-3", "fp"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
			require.EqualValues(t, codes.Aborted, replay.GetRecord().GetResult().GetFailure().GetCode())
		})
	}
}

func TestResolveValidation(t *testing.T) {
	admin := idemregv1.NewAdminServiceClient(start(t, memStore(t), server.Config{Limits: func() server.Limits {
		l := server.DefaultLimits()
		l.MaxResultBytes = 1024
		return l
	}()}))
	big := response(strings.Repeat("x", 1024))
	for _, tc := range []struct {
		name   string
		req    *idemregv1.ResolveRecordRequest
		fields []string
	}{
		{"no resolution", resolveReq("k", 1, "why"), []string{"resolution"}},
		{"release false", func() *idemregv1.ResolveRecordRequest {
			r := resolveReq("k", 1, "why")
			r.Resolution = &idemregv1.ResolveRecordRequest_Release{}
			return r
		}(), []string{"release"}},
		{"empty result", completing(resolveReq("k", 1, "why"), &idemregv1.Result{}), []string{"result"}},
		{"failure code OK", completing(resolveReq("k", 1, "why"), &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{}}}), []string{"result.failure.code"}},
		{"response type not UTF-8", completing(resolveReq("k", 1, "why"), &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "\xff"}}}), []string{"result.response.type"}},
		{"result over the server's limit, as Complete's", completing(resolveReq("k", 1, "why"), big), []string{"result"}},
		{"no token", releasing(resolveReq("k", 0, "why")), []string{"token"}},
		{"negative token", releasing(resolveReq("k", -5, "why")), []string{"token"}},
		{"no reason", releasing(resolveReq("k", 1, "")), []string{"reason"}},
		{"reason too long", releasing(resolveReq("k", 1, strings.Repeat("x", server.MaxReasonBytes+1))), []string{"reason"}},
		{"reason with a newline", releasing(resolveReq("k", 1, "a\nb")), []string{"reason"}},
		{"everything", &idemregv1.ResolveRecordRequest{Consumer: "bad consumer", Kind: 9}, []string{"consumer", "kind", "key", "token", "reason", "resolution"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := admin.ResolveRecord(t.Context(), tc.req)
			st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, tc.fields, violatedFields(st))
		})
	}
	_, err := admin.ResolveRecord(t.Context(), releasing(resolveReq("k", 1, strings.Repeat("é", server.MaxReasonBytes/2))))
	requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound) // valid: 256 bytes
}

// TestResolveRaces: of two operators resolving with the same token, one
// wins and the other gets LEASE_LOST; a resolution racing a Claim's
// takeover of the same expired lease is either first, and the Claim sees
// its outcome, or second, and LEASE_LOST.
func TestResolveRaces(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		admin := idemregv1.NewAdminServiceClient(h.conn)
		race := func(a, b func() error) (errA, errB error) {
			var wg sync.WaitGroup
			gate := make(chan struct{})
			wg.Go(func() { <-gate; errA = a() })
			wg.Go(func() { <-gate; errB = b() })
			close(gate)
			wg.Wait()
			return errA, errB
		}
		for i := range 6 {
			key := fmt.Sprintf("both-%d", i)
			held, err := h.client.Claim(ctx, claimReq(key, "fp"))
			require.NoError(t, err)
			errRelease, errComplete := race(func() error {
				_, err := admin.ResolveRecord(ctx, releasing(resolveReq(key, held.GetToken(), "operator A")))
				return err
			}, func() error {
				_, err := admin.ResolveRecord(ctx, completing(resolveReq(key, held.GetToken(), "operator B"), response("by B")))
				return err
			})
			require.True(t, (errRelease == nil) != (errComplete == nil), "exactly one wins: %v, %v", errRelease, errComplete)
			lost, winner := errComplete, "operator A"
			if errRelease != nil {
				lost, winner = errRelease, "operator B"
			}
			requireStatus(t, lost, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
			insp, err := admin.InspectRecord(ctx, inspectReq(payments, key))
			require.NoError(t, err)
			require.Len(t, insp.GetHistory(), 1, "one resolution happened")
			require.Equal(t, winner, insp.GetHistory()[0].GetNote())
		}

		for i := range 6 {
			key := fmt.Sprintf("claim-%d", i)
			held, err := h.client.Claim(ctx, claimReq(key, "fp"))
			require.NoError(t, err)
			h.clock.Advance(11 * time.Second) // the lease ran out: a Claim takes over
			withResult := i%2 == 1
			resolve := resolveReq(key, held.GetToken(), "stuck")
			if withResult {
				completing(resolve, response("by hand"))
			} else {
				releasing(resolve)
			}
			var claimed *idemregv1.ClaimResponse
			errResolve, errClaim := race(func() error {
				_, err := admin.ResolveRecord(ctx, resolve)
				return err
			}, func() (err error) {
				claimed, err = h.client.Claim(ctx, claimReq(key, "fp"))
				return err
			})
			require.NoError(t, errClaim)
			insp, err := admin.InspectRecord(ctx, inspectReq(payments, key))
			require.NoError(t, err)
			endOf := map[int64]idemregv1.AttemptEnd{}
			for _, a := range insp.GetHistory() {
				endOf[a.GetToken()] = a.GetEnd()
			}
			switch {
			case errResolve != nil: // the Claim took over first
				requireStatus(t, errResolve, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
				require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, claimed.GetOutcome())
				require.EqualValues(t, 2, claimed.GetRecord().GetAttempt())
				require.Equal(t, idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER, endOf[held.GetToken()])
			case withResult: // resolved first: the Claim replays
				require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, claimed.GetOutcome())
				require.True(t, proto.Equal(response("by hand"), claimed.GetRecord().GetResult()))
				require.Equal(t, idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_COMPLETED, endOf[held.GetToken()])
			default: // released first: the Claim acquires afresh
				if claimed.GetOutcome() == idemregv1.Outcome_OUTCOME_IN_PROGRESS {
					// The release ended the lease at its own clock
					// reading, a moment after the Claim's (a SQL
					// statement reads the clock when it starts and may
					// see a row committed later): retry after that moment.
					require.Less(t, claimed.GetRetryAfter().AsDuration(), time.Second)
					claimed, err = h.client.Claim(ctx, claimReq(key, "fp"))
					require.NoError(t, err)
				}
				require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, claimed.GetOutcome())
				require.EqualValues(t, 1, claimed.GetRecord().GetAttempt())
				require.Equal(t, idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED, endOf[held.GetToken()])
			}
		}
	})
}

// listed is what TestListRecords stores: per key, its consumer,
// state, attempt and whether it was created in the first hour.
type listed struct {
	consumer, key string
	state         idemregv1.State
	attempt       int64
	early         bool
}

func TestListRecords(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client
		admin := idemregv1.NewAdminServiceClient(h.conn)
		var all []listed
		claim := func(consumer, key string) *idemregv1.ClaimResponse {
			req := claimReq(key, "fp")
			req.Consumer = consumer
			res, err := c.Claim(ctx, req)
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
			return res
		}
		park := func(consumer, key string, held *idemregv1.ClaimResponse) {
			_, err := c.Park(ctx, &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
				Token: held.GetToken(), ClaimSecret: held.GetClaimSecret(), Reason: "unknown outcome"})
			require.NoError(t, err)
		}
		// list.a: 30 records in the first hour, a third completed, some
		// parked, the rest in progress; four of those taken over later.
		for i := range 30 {
			key := fmt.Sprintf("a-%02d", i)
			held := claim("list.a", key)
			r := listed{consumer: "list.a", key: key, state: idemregv1.State_STATE_IN_PROGRESS, attempt: 1, early: true}
			switch {
			case i%3 == 0:
				_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "list.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
					Token: held.GetToken(), ClaimSecret: held.GetClaimSecret(), Result: response("SECRET-result")})
				require.NoError(t, err)
				r.state = idemregv1.State_STATE_COMPLETED
			case i%5 == 0:
				park("list.a", key, held)
				r.state = idemregv1.State_STATE_PARKED
			}
			all = append(all, r)
		}
		h.clock.Advance(time.Hour)
		for i := range all {
			if r := &all[i]; r.state == idemregv1.State_STATE_IN_PROGRESS && i%7 == 1 {
				require.EqualValues(t, 2, claim(r.consumer, r.key).GetRecord().GetAttempt())
				r.attempt = 2
			}
		}
		for _, consumer := range []string{"list.b", "listx.c"} {
			for i := range 10 {
				key := fmt.Sprintf("%c-%02d", consumer[len(consumer)-1], i)
				held := claim(consumer, key)
				r := listed{consumer: consumer, key: key, state: idemregv1.State_STATE_IN_PROGRESS, attempt: 1}
				if i == 4 {
					park(consumer, key, held)
					r.state = idemregv1.State_STATE_PARKED
				}
				all = append(all, r)
			}
		}
		h.clock.Advance(time.Minute)

		// listAll follows the pages of req and returns the keys listed.
		listAll := func(t *testing.T, req *idemregv1.ListRecordsRequest) []string {
			t.Helper()
			var keys []string
			for pages := 0; ; pages++ {
				require.Less(t, pages, 100, "the listing ends")
				res, err := admin.ListRecords(ctx, req)
				require.NoError(t, err)
				require.LessOrEqual(t, len(res.GetRecords()), int(req.GetPageSize()))
				require.NotNil(t, res.GetStoreTime())
				for _, r := range res.GetRecords() {
					rec := r.GetRecord()
					require.Nil(t, rec.GetResult(), "a listing carries no result")
					require.NotZero(t, rec.GetToken(), "an operator sees the token to resolve with")
					require.Len(t, r.GetHistory(), int(rec.GetAttempt()-1), "one taken over attempt per takeover")
					keys = append(keys, rec.GetConsumer()+"/"+rec.GetKey())
				}
				if res.GetNextPageToken() == "" {
					return keys
				}
				req = proto.CloneOf(req)
				req.PageToken = res.GetNextPageToken()
			}
		}
		want := func(keep func(r listed) bool) []string {
			var keys []string
			for _, r := range all {
				if keep(r) {
					keys = append(keys, r.consumer+"/"+r.key)
				}
			}
			slices.Sort(keys)
			return keys
		}
		state := func(s idemregv1.State) func(r listed) bool { return func(r listed) bool { return r.state == s } }
		and := func(fs ...func(r listed) bool) func(r listed) bool {
			return func(r listed) bool {
				for _, f := range fs {
					if !f(r) {
						return false
					}
				}
				return true
			}
		}
		consumer := func(c string) func(r listed) bool { return func(r listed) bool { return r.consumer == c } }
		prefix := func(p string) func(r listed) bool {
			return func(r listed) bool { return strings.HasPrefix(r.consumer, p) }
		}
		for _, tc := range []struct {
			name string
			req  *idemregv1.ListRecordsRequest
			keep func(r listed) bool
		}{
			{"one consumer", &idemregv1.ListRecordsRequest{Consumer: "list.a"}, consumer("list.a")},
			{"parked", &idemregv1.ListRecordsRequest{Consumer: "list.a", State: idemregv1.State_STATE_PARKED}, and(consumer("list.a"), state(idemregv1.State_STATE_PARKED))},
			{"completed", &idemregv1.ListRecordsRequest{Consumer: "list.a", State: idemregv1.State_STATE_COMPLETED}, and(consumer("list.a"), state(idemregv1.State_STATE_COMPLETED))},
			{"taken over", &idemregv1.ListRecordsRequest{Consumer: "list.a", MinAttempt: 2}, and(consumer("list.a"), func(r listed) bool { return r.attempt >= 2 })},
			{"prefix", &idemregv1.ListRecordsRequest{Consumer: "list.", ConsumerPrefix: true}, prefix("list.")},
			{"shorter prefix", &idemregv1.ListRecordsRequest{Consumer: "list", ConsumerPrefix: true}, prefix("list")},
			{"every consumer, parked", &idemregv1.ListRecordsRequest{ConsumerPrefix: true, State: idemregv1.State_STATE_PARKED}, state(idemregv1.State_STATE_PARKED)},
			{"older than half an hour", &idemregv1.ListRecordsRequest{Consumer: "list", ConsumerPrefix: true, OlderThan: durationpb.New(30 * time.Minute)},
				func(r listed) bool { return r.early }},
			{"older than anything", &idemregv1.ListRecordsRequest{ConsumerPrefix: true, OlderThan: durationpb.New(24 * time.Hour)}, func(listed) bool { return false }},
			{"in progress, taken over, by prefix", &idemregv1.ListRecordsRequest{Consumer: "list.", ConsumerPrefix: true, State: idemregv1.State_STATE_IN_PROGRESS, MinAttempt: 2},
				and(prefix("list."), state(idemregv1.State_STATE_IN_PROGRESS), func(r listed) bool { return r.attempt >= 2 })},
		} {
			t.Run(tc.name, func(t *testing.T) {
				for _, size := range []int32{7, 500} {
					req := proto.CloneOf(tc.req)
					req.PageSize = size
					got := listAll(t, req)
					require.Equal(t, want(tc.keep), got, "page size %d: every match once, in key order", size)
				}
			})
		}

		// The page token belongs to its filters; page_size may change.
		first, err := admin.ListRecords(ctx, &idemregv1.ListRecordsRequest{Consumer: "list.a", PageSize: 5})
		require.NoError(t, err)
		token := first.GetNextPageToken()
		require.NotEmpty(t, token)
		next, err := admin.ListRecords(ctx, &idemregv1.ListRecordsRequest{Consumer: "list.a", PageSize: 3, PageToken: token})
		require.NoError(t, err)
		require.Equal(t, "a-05", next.GetRecords()[0].GetRecord().GetKey(), "the next page starts after the last")
		raw, err := base64.RawURLEncoding.DecodeString(token)
		require.NoError(t, err)
		raw[len(raw)-1] ^= 1
		for _, tc := range []struct {
			name string
			req  *idemregv1.ListRecordsRequest
		}{
			{"another state", &idemregv1.ListRecordsRequest{Consumer: "list.a", State: idemregv1.State_STATE_PARKED, PageToken: token}},
			{"another consumer", &idemregv1.ListRecordsRequest{Consumer: "list.b", PageToken: token}},
			{"as a prefix", &idemregv1.ListRecordsRequest{Consumer: "list.a", ConsumerPrefix: true, PageToken: token}},
			{"another min_attempt", &idemregv1.ListRecordsRequest{Consumer: "list.a", MinAttempt: 1, PageToken: token}},
			{"another older_than", &idemregv1.ListRecordsRequest{Consumer: "list.a", OlderThan: durationpb.New(time.Second), PageToken: token}},
			{"garbled", &idemregv1.ListRecordsRequest{Consumer: "list.a", PageToken: "not-a-token"}},
			{"not base64", &idemregv1.ListRecordsRequest{Consumer: "list.a", PageToken: "?!"}},
			{"cut short", &idemregv1.ListRecordsRequest{Consumer: "list.a", PageToken: token[:12]}},
			{"tampered", &idemregv1.ListRecordsRequest{Consumer: "list.a", PageToken: base64.RawURLEncoding.EncodeToString(raw[:len(raw)-3])}},
			{"too long", &idemregv1.ListRecordsRequest{Consumer: "list.a", PageToken: strings.Repeat("A", server.MaxPageTokenBytes+1)}},
		} {
			t.Run("page token "+tc.name, func(t *testing.T) {
				_, err := admin.ListRecords(ctx, tc.req)
				st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
				require.Equal(t, []string{"page_token"}, violatedFields(st))
			})
		}
	})
}

func TestListValidation(t *testing.T) {
	admin := idemregv1.NewAdminServiceClient(start(t, memStore(t), server.Config{}))
	for _, tc := range []struct {
		name   string
		req    *idemregv1.ListRecordsRequest
		fields []string
	}{
		{"no consumer", &idemregv1.ListRecordsRequest{}, []string{"consumer"}},
		{"bad consumer", &idemregv1.ListRecordsRequest{Consumer: "a b"}, []string{"consumer"}},
		{"bad prefix", &idemregv1.ListRecordsRequest{Consumer: "a*", ConsumerPrefix: true}, []string{"consumer"}},
		{"prefix too long", &idemregv1.ListRecordsRequest{Consumer: strings.Repeat("a", server.MaxConsumerBytes+1), ConsumerPrefix: true}, []string{"consumer"}},
		{"unknown state", &idemregv1.ListRecordsRequest{Consumer: "c", State: 42}, []string{"state"}},
		{"negative min_attempt", &idemregv1.ListRecordsRequest{Consumer: "c", MinAttempt: -1}, []string{"min_attempt"}},
		{"negative older_than", &idemregv1.ListRecordsRequest{Consumer: "c", OlderThan: durationpb.New(-time.Second)}, []string{"older_than"}},
		{"older_than beyond any retention", &idemregv1.ListRecordsRequest{Consumer: "c", OlderThan: durationpb.New(server.MaxListOlderThan + time.Second)}, []string{"older_than"}},
		{"invalid older_than", &idemregv1.ListRecordsRequest{Consumer: "c", OlderThan: &durationpb.Duration{Seconds: 1, Nanos: -1}}, []string{"older_than"}},
		{"page too large", &idemregv1.ListRecordsRequest{Consumer: "c", PageSize: server.MaxListPageSize + 1}, []string{"page_size"}},
		{"negative page", &idemregv1.ListRecordsRequest{Consumer: "c", PageSize: -1}, []string{"page_size"}},
		{"filters first, then the token", &idemregv1.ListRecordsRequest{Consumer: "c", MinAttempt: -1, PageToken: "garbled"}, []string{"min_attempt"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := admin.ListRecords(t.Context(), tc.req)
			st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, tc.fields, violatedFields(st))
		})
	}
	for _, req := range []*idemregv1.ListRecordsRequest{
		{ConsumerPrefix: true},
		{Consumer: "c", PageSize: server.MaxListPageSize, State: idemregv1.State_STATE_PARKED, OlderThan: durationpb.New(server.MaxListOlderThan)},
	} {
		res, err := admin.ListRecords(t.Context(), req)
		require.NoError(t, err, "%v", req)
		require.Empty(t, res.GetRecords())
		require.Empty(t, res.GetNextPageToken())
	}
	_, err := admin.CountParked(t.Context(), &idemregv1.CountParkedRequest{ConsumerPrefix: "a b"})
	st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{"consumer_prefix"}, violatedFields(st))
}

// TestAdminByPrefixPermissions: a listing or a count by prefix shows only
// the consumers the identity may administer, and is refused when it may
// administer none under the prefix; by one consumer, as InspectRecord.
func TestAdminByPrefixPermissions(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: worker, token_hashes: ["`+access.HashToken("worker-token")+`"], consumers: ["*"]}
  - {name: ops, token_hashes: ["`+access.HashToken("ops-token")+`"], admin: ["billing.*"]}
  - {name: inbox, token_hashes: ["`+access.HashToken("inbox-token")+`"], admin: ["orders.inbox"]}
`)
	spy := &spyStore{Store: memStore(t)}
	conn := start(t, spy, server.Config{Access: src})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	worker := bearer(t.Context(), "worker-token")
	held := map[string]*idemregv1.ClaimResponse{}
	for _, consumer := range []string{"billing.a", "billing.b", "orders.inbox", "orders.inbox2", "payments"} {
		res, err := c.Claim(worker, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "k"})
		require.NoError(t, err)
		held[consumer] = res
		if consumer != "billing.b" {
			_, err = c.Park(worker, &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "k",
				Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Reason: "unknown"})
			require.NoError(t, err)
		}
	}
	list := func(token string, req *idemregv1.ListRecordsRequest) ([]string, error) {
		res, err := admin.ListRecords(bearer(t.Context(), token), req)
		var consumers []string
		for _, r := range res.GetRecords() {
			consumers = append(consumers, r.GetRecord().GetConsumer())
		}
		return consumers, err
	}
	count := func(token, prefix string) (map[string]int64, error) {
		res, err := admin.CountParked(bearer(t.Context(), token), &idemregv1.CountParkedRequest{ConsumerPrefix: prefix})
		return res.GetParked(), err
	}
	for _, tc := range []struct {
		name, token string
		req         *idemregv1.ListRecordsRequest
		want        []string // nil: PERMISSION_DENIED
	}{
		{"every consumer: only those granted", "ops-token", &idemregv1.ListRecordsRequest{ConsumerPrefix: true}, []string{"billing.a", "billing.b"}},
		{"a prefix wider than the grant", "ops-token", &idemregv1.ListRecordsRequest{Consumer: "bill", ConsumerPrefix: true}, []string{"billing.a", "billing.b"}},
		{"the granted prefix", "ops-token", &idemregv1.ListRecordsRequest{Consumer: "billing.", ConsumerPrefix: true, State: idemregv1.State_STATE_PARKED}, []string{"billing.a"}},
		{"one granted consumer", "ops-token", &idemregv1.ListRecordsRequest{Consumer: "billing.b"}, []string{"billing.b"}},
		{"one consumer not granted", "ops-token", &idemregv1.ListRecordsRequest{Consumer: "orders.inbox"}, nil},
		{"a prefix with nothing granted", "ops-token", &idemregv1.ListRecordsRequest{Consumer: "orders.", ConsumerPrefix: true}, nil},
		{"a granted name under a prefix", "inbox-token", &idemregv1.ListRecordsRequest{Consumer: "orders.", ConsumerPrefix: true}, []string{"orders.inbox"}},
		{"a granted name among all", "inbox-token", &idemregv1.ListRecordsRequest{ConsumerPrefix: true}, []string{"orders.inbox"}},
		{"no admin grant", "worker-token", &idemregv1.ListRecordsRequest{ConsumerPrefix: true}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := spy.calls.Load()
			got, err := list(tc.token, tc.req)
			if tc.want == nil {
				requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
				require.Equal(t, before, spy.calls.Load(), "refused before the store was called")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}

	// Paging past the records of consumers the identity may not
	// administer: their pages come back empty, and their keys do not show
	// through the page tokens.
	var seen []string
	req := &idemregv1.ListRecordsRequest{ConsumerPrefix: true, PageSize: 1}
	for pages := 0; ; pages++ {
		require.Less(t, pages, 10)
		res, err := admin.ListRecords(bearer(t.Context(), "inbox-token"), req)
		require.NoError(t, err)
		for _, r := range res.GetRecords() {
			seen = append(seen, r.GetRecord().GetConsumer())
		}
		if res.GetNextPageToken() == "" {
			break
		}
		raw, err := base64.RawURLEncoding.DecodeString(res.GetNextPageToken())
		require.NoError(t, err)
		for _, hidden := range []string{"billing", "payments", "inbox2"} {
			require.NotContains(t, string(raw), hidden, "a page token is sealed")
		}
		req.PageToken = res.GetNextPageToken()
	}
	require.Equal(t, []string{"orders.inbox"}, seen)

	got, err := count("ops-token", "")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"billing.a": 1}, got)
	got, err = count("inbox-token", "orders.")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"orders.inbox": 1}, got, "not orders.inbox2")
	_, err = count("ops-token", "orders.")
	requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	_, err = count("worker-token", "")
	requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)

	resolve := func(token, consumer string) error {
		_, err := admin.ResolveRecord(bearer(t.Context(), token), &idemregv1.ResolveRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION,
			Key: "k", Token: held[consumer].GetToken(), Reason: "resolved", Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
		return err
	}
	requireStatus(t, resolve("ops-token", "orders.inbox"), codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	requireStatus(t, resolve("worker-token", "orders.inbox"), codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	require.NoError(t, resolve("inbox-token", "orders.inbox"))
}

// TestAdminAudit: every admin call is an audit line (who, what, the
// reason) and a count; resolutions at WARN with how the record was
// resolved and the attempt they ended, listings at INFO; never a token or
// a result.
func TestAdminAudit(t *testing.T) {
	var buf syncBuffer
	reader := sdkmetric.NewManualReader()
	conn := start(t, memStore(t), server.Config{Logger: jsonLogger(&buf), MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	one, err := c.Claim(ctx, claimReq("audit-1", "fp"))
	require.NoError(t, err)
	two, err := c.Claim(ctx, claimReq("audit-2", "fp"))
	require.NoError(t, err)
	_, err = admin.ResolveRecord(ctx, releasing(resolveReq("audit-1", one.GetToken(), "handler fixed, OPS-9")))
	require.NoError(t, err)
	_, err = admin.ResolveRecord(ctx, releasing(resolveReq("audit-1", one.GetToken(), "too late")))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
	_, err = admin.ResolveRecord(ctx, completing(resolveReq("audit-2", two.GetToken(), "charged, OPS-10"), response("SECRET-data")))
	require.NoError(t, err)
	_, err = admin.ResolveRecord(ctx, completing(resolveReq("audit-2", two.GetToken()+1, "again"), response("x")))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
	_, err = admin.ListRecords(ctx, &idemregv1.ListRecordsRequest{Consumer: "billing.", ConsumerPrefix: true, State: idemregv1.State_STATE_COMPLETED})
	require.NoError(t, err)
	_, err = admin.CountParked(ctx, &idemregv1.CountParkedRequest{ConsumerPrefix: "billing."})
	require.NoError(t, err)

	logs := buf.String()
	require.NotContains(t, logs, "SECRET")
	for _, tok := range []int64{one.GetToken(), two.GetToken()} {
		require.NotContains(t, logs, strconv.FormatInt(tok, 10))
	}
	lines := buf.lines(t, "admin action")
	require.Len(t, lines, 6)
	for _, l := range lines {
		require.Equal(t, "anonymous", l["identity"])
	}
	released, lost, completed, listing, counting := lines[0], lines[1], lines[2], lines[4], lines[5]
	require.Equal(t, "WARN", released["level"])
	require.Equal(t, "resolve", released["action"])
	require.Equal(t, "released", released["resolution"])
	require.EqualValues(t, 1, released["attempt"], "the attempt the resolution ended")
	require.Equal(t, "handler fixed, OPS-9", released["reason"])
	require.Equal(t, "audit-1", released["key"])
	require.Equal(t, "ok", released["result"])
	require.Equal(t, idemregv1.ReasonLeaseLost, lost["result"])
	require.NotContains(t, lost, "attempt")
	require.Equal(t, "completed", completed["resolution"])
	require.Equal(t, "response", completed["result_outcome"])
	require.Equal(t, false, completed["response_checked"], "test.Reply is no type the server knows: stored unchecked, and the line says so")
	require.Equal(t, false, completed["response_from_json"])
	require.EqualValues(t, 1, completed["attempt"])
	require.Equal(t, "INFO", listing["level"])
	require.Equal(t, "list", listing["action"])
	require.Equal(t, "billing.", listing["consumer"])
	require.Equal(t, true, listing["consumer_prefix"])
	require.Equal(t, "STATE_COMPLETED", listing["state"])
	require.EqualValues(t, 1, listing["records"])
	require.Equal(t, "INFO", counting["level"])
	require.Equal(t, "count_parked", counting["action"])
	require.Equal(t, "billing.", counting["consumer_prefix"])

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	actions := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == server.MetricAdminActions {
				for _, dp := range d.DataPoints {
					a, _ := dp.Attributes.Value("action")
					r, _ := dp.Attributes.Value("result")
					actions[a.AsString()+" "+r.AsString()] += dp.Value
				}
			}
		}
	}
	require.Equal(t, map[string]int64{"resolve ok": 2, "resolve " + idemregv1.ReasonLeaseLost: 2, "list ok": 1, "count_parked ok": 1}, actions)
}

// parkedGauge reads idemreg.parked_records by consumer; nil when it has
// no data point.
func parkedGauge(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	var out map[string]int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == server.MetricParkedRecords {
				for _, dp := range g.DataPoints {
					if out == nil {
						out = map[string]int64{}
					}
					v, _ := dp.Attributes.Value("consumer")
					out[v.AsString()] = dp.Value
				}
			}
		}
	}
	return out
}

// TestParkedGauge: the gauge reports the store's count of parked records
// per consumer, as of the last count.
func TestParkedGauge(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			store := b.open(t, &storagetest.Clock{})
			// A count when the test says so: the loop's interval is long.
			reader := sdkmetric.NewManualReader()
			addr, srv := servertest.Serve(t, store, server.Config{ParkedCountInterval: time.Hour, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
			conn := servertest.Dial(t, addr)
			c := idemregv1.NewRegistryServiceClient(conn)
			ctx := t.Context()
			park := func(consumer, key string) *idemregv1.ClaimResponse {
				res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key})
				require.NoError(t, err)
				_, err = c.Park(ctx, &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
					Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Reason: "unknown"})
				require.NoError(t, err)
				return res
			}
			first := park("gauge.a", "m-1")
			park("gauge.a", "m-2")
			park("gauge.b", "m-1")
			_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "gauge.c", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
			require.NoError(t, err)

			require.NoError(t, server.CountParkedNow(ctx, srv))
			require.Equal(t, map[string]int64{"gauge.a": 2, "gauge.b": 1}, parkedGauge(t, reader))

			_, err = idemregv1.NewAdminServiceClient(conn).ResolveRecord(ctx, &idemregv1.ResolveRecordRequest{Consumer: "gauge.a", Kind: idemregv1.Kind_KIND_MESSAGE,
				Key: "m-1", Token: first.GetToken(), Reason: "dead-lettered", Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
			require.NoError(t, err)
			require.Equal(t, map[string]int64{"gauge.a": 2, "gauge.b": 1}, parkedGauge(t, reader), "as of the last count")
			require.NoError(t, server.CountParkedNow(ctx, srv))
			require.Equal(t, map[string]int64{"gauge.a": 1, "gauge.b": 1}, parkedGauge(t, reader))

			// The loop counts on its own, at start and every interval.
			looping := sdkmetric.NewManualReader()
			servertest.Serve(t, store, server.Config{ParkedCountInterval: 10 * time.Millisecond, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(looping))})
			require.Eventually(t, func() bool { return parkedGauge(t, looping)["gauge.a"] == 1 }, 10*time.Second, 10*time.Millisecond)

			// Off: no number at all, rather than a stale or a false one.
			off := sdkmetric.NewManualReader()
			servertest.Serve(t, store, server.Config{ParkedCountInterval: -1, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(off))})
			require.Nil(t, parkedGauge(t, off))
		})
	}
}
