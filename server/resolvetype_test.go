package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/server/servertest"
)

// Issue 24, point 3: a resolution's response of a type the registry knows
// must decode as that type, and may be given as JSON, which the server
// encodes; a type it does not know is stored as given.

const int64Value = "google.protobuf.Int64Value"

func responseOf(typ string, data []byte) *idemregv1.Result {
	return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: typ, Data: data}}}
}

func resolvingJSON(r *idemregv1.ResolveRecordRequest, typ, json string) *idemregv1.ResolveRecordRequest {
	r.Resolution = &idemregv1.ResolveRecordRequest_ResponseJson{ResponseJson: &idemregv1.JsonResponse{Type: typ, Json: json}}
	return r
}

// violation is the description of the BadRequest violation of field.
func violation(t *testing.T, err error, field string) string {
	t.Helper()
	st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{field}, violatedFields(st))
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			return br.GetFieldViolations()[0].GetDescription()
		}
	}
	return ""
}

// TestResolveRefusesUndecodableResponse reproduces the broken repair of
// the issue: an Int64Value resolved with JSON as its bytes was stored, and
// every retry of the key failed to decode it. It is refused now, the
// record left as it was; the same value given as JSON is stored in the
// wire format, which a Claim replays and decodes.
func TestResolveRefusesUndecodableResponse(t *testing.T) {
	conn := start(t, memStore(t), server.Config{})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	stuck, err := c.Claim(ctx, claimReq("pay-int", "fp"))
	require.NoError(t, err)

	_, err = admin.ResolveRecord(ctx, completing(resolveReq("pay-int", stuck.GetToken(), "repair, OPS-24"), responseOf(int64Value, []byte(`{"value":10}`))))
	desc := violation(t, err, "result.response.data")
	require.Contains(t, desc, "does not decode as google.protobuf.Int64Value")
	require.Contains(t, desc, "response_json", "says how to give it as JSON")
	insp, err := admin.InspectRecord(ctx, inspectReq(payments, "pay-int"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, insp.GetRecord().GetState(), "nothing was stored")
	require.Equal(t, stuck.GetToken(), insp.GetRecord().GetToken())

	done, err := admin.ResolveRecord(ctx, resolvingJSON(resolveReq("pay-int", stuck.GetToken(), "repair, OPS-24"), int64Value, `{"value":"10"}`))
	require.NoError(t, err)
	require.True(t, done.GetResponseChecked())
	replay, err := c.Claim(ctx, claimReq("pay-int", "fp"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	resp := replay.GetRecord().GetResult().GetResponse()
	require.Equal(t, int64Value, resp.GetType())
	var got wrapperspb.Int64Value
	require.NoError(t, proto.Unmarshal(resp.GetData(), &got), "the replay decodes as its type")
	require.EqualValues(t, 10, got.GetValue())
	want, err := proto.Marshal(wrapperspb.Int64(10))
	require.NoError(t, err)
	require.Equal(t, want, resp.GetData(), "stored in the wire format")
}

// TestResolveResponseTypes: what a resolution's response is checked
// against, for the linked types and for a type the server does not know.
func TestResolveResponseTypes(t *testing.T) {
	conn := start(t, memStore(t), server.Config{})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	wire, err := proto.Marshal(wrapperspb.String("ok"))
	require.NoError(t, err)

	for _, tc := range []struct {
		name    string
		req     func(*idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest
		field   string // the violation, "" when accepted
		checked bool
	}{
		{"a well-known type's wire format", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return completing(r, responseOf("google.protobuf.StringValue", wire))
		}, "", true},
		{"a linked type of ours, undecodable", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return completing(r, responseOf("idemreg.v1.Record", []byte{0xff, 0xff}))
		}, "result.response.data", false},
		{"a type the server does not know, stored as given", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return completing(r, responseOf("payments.v1.Charge", []byte("charge-1")))
		}, "", false},
		{"JSON of a type the server does not know", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return resolvingJSON(r, "payments.v1.Charge", `{"id":"charge-1"}`)
		}, "response_json.type", false},
		{"JSON without a type", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return resolvingJSON(r, "", `{"value":"10"}`)
		}, "response_json.type", false},
		{"JSON that is not of the type", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return resolvingJSON(r, int64Value, `{"amount":10}`)
		}, "response_json.json", false},
		{"JSON that is not JSON", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return resolvingJSON(r, int64Value, `value: 10`)
		}, "response_json.json", false},
		{"JSON of a well-known type", func(r *idemregv1.ResolveRecordRequest) *idemregv1.ResolveRecordRequest {
			return resolvingJSON(r, "google.protobuf.Timestamp", `"2026-01-02T03:04:05Z"`)
		}, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "types-" + tc.name
			stuck, err := c.Claim(ctx, claimReq(key, "fp"))
			require.NoError(t, err)
			done, err := admin.ResolveRecord(ctx, tc.req(resolveReq(key, stuck.GetToken(), "repair")))
			if tc.field != "" {
				violation(t, err, tc.field)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.checked, done.GetResponseChecked())
			require.Equal(t, idemregv1.State_STATE_COMPLETED, done.GetRecord().GetState())
		})
	}
}

// TestResolveWithDescriptorSet: a server given the descriptor set of an
// operator's type checks and encodes its responses as it does the linked
// types'; without it, the same type is unknown.
func TestResolveWithDescriptorSet(t *testing.T) {
	types, err := resulttype.Load(servertest.WriteDescriptorSet(t, servertest.ChargeDescriptorSet()))
	require.NoError(t, err)
	conn := start(t, memStore(t), server.Config{ResultTypes: types})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	stuck, err := c.Claim(ctx, claimReq("charge-1", "fp"))
	require.NoError(t, err)

	_, err = admin.ResolveRecord(ctx, completing(resolveReq("charge-1", stuck.GetToken(), "repair"), responseOf(servertest.ChargeResponse, []byte("charge-1"))))
	require.Contains(t, violation(t, err, "result.response.data"), "does not decode as payments.v1.ChargeResponse")

	done, err := admin.ResolveRecord(ctx, resolvingJSON(resolveReq("charge-1", stuck.GetToken(), "repair"), servertest.ChargeResponse,
		`{"chargeId":"ch_1","account":"acct-9","amountMinor":"1250","currency":"EUR"}`))
	require.NoError(t, err)
	require.True(t, done.GetResponseChecked())
	replay, err := c.Claim(ctx, claimReq("charge-1", "fp"))
	require.NoError(t, err)
	resp := replay.GetRecord().GetResult().GetResponse()
	require.Equal(t, servertest.ChargeResponse, resp.GetType())
	mt, ok := types.Find(servertest.ChargeResponse)
	require.True(t, ok)
	got := mt.New().Interface()
	require.NoError(t, proto.Unmarshal(resp.GetData(), got))
	fields := got.ProtoReflect().Descriptor().Fields()
	require.Equal(t, "ch_1", got.ProtoReflect().Get(fields.ByName("charge_id")).String())
	require.EqualValues(t, 1250, got.ProtoReflect().Get(fields.ByName("amount_minor")).Int())

	// Without the set, the type is one the server cannot know.
	plain := idemregv1.NewAdminServiceClient(start(t, memStore(t), server.Config{}))
	_, err = plain.ResolveRecord(ctx, resolvingJSON(resolveReq("charge-1", 1, "repair"), servertest.ChargeResponse, `{"chargeId":"ch_1"}`))
	require.Contains(t, violation(t, err, "response_json.type"), "--descriptor-set")
}

// TestResolveRepairsACompletedRecord: a key completed with bytes that do
// not decode (stored before the checks, by a Complete, which is not
// checked) is repaired in one step: its result replaced with the token the
// operator inspected, the record still completed, and every later Claim
// replays the repair and decodes it.
func TestResolveRepairsACompletedRecord(t *testing.T) {
	conn := start(t, memStore(t), server.Config{})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	ctx := t.Context()
	cl, err := c.Claim(ctx, claimReq("pay-broken", "fp"))
	require.NoError(t, err)
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: payments, Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-broken",
		Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: responseOf(int64Value, []byte(`{"value":10}`))})
	require.NoError(t, err)
	insp, err := admin.InspectRecord(ctx, inspectReq(payments, "pay-broken"))
	require.NoError(t, err)

	_, err = admin.ResolveRecord(ctx, resolvingJSON(resolveReq("pay-broken", insp.GetRecord().GetToken(), "stored JSON, OPS-24"), int64Value, `{"value":"10"}`))
	require.NoError(t, err)
	replay, err := c.Claim(ctx, claimReq("pay-broken", "fp"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	var got wrapperspb.Int64Value
	require.NoError(t, proto.Unmarshal(replay.GetRecord().GetResult().GetResponse().GetData(), &got))
	require.EqualValues(t, 10, got.GetValue())
	_, err = c.Claim(ctx, claimReq("pay-broken", "other"))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "the repaired key keeps its fingerprint")

	insp, err = admin.InspectRecord(ctx, inspectReq(payments, "pay-broken"))
	require.NoError(t, err)
	release := resolveReq("pay-broken", insp.GetRecord().GetToken(), "drop it")
	release.Resolution = &idemregv1.ResolveRecordRequest_Release{Release: true}
	_, err = admin.ResolveRecord(ctx, release)
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "a completed record is not released: %v", err)
}
