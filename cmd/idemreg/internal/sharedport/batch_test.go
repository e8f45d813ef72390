package sharedport

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// postJSON POSTs body as JSON to a RegistryService method with the API's
// token, and returns the HTTP status and the body.
func (s *apiServer) postJSON(t *testing.T, method string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.base+"/idemreg.v1.RegistryService/"+method, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+apiToken)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, b
}

// batchJSON sends req as JSON to Batch and decodes the answer, which must
// be a 200.
func (s *apiServer) batchJSON(t *testing.T, req *idemregv1.BatchRequest) *idemregv1.BatchResponse {
	t.Helper()
	body, err := protojson.Marshal(req)
	require.NoError(t, err)
	code, b := s.postJSON(t, "Batch", body)
	require.Equal(t, http.StatusOK, code, "%.500s", b)
	var res idemregv1.BatchResponse
	require.NoError(t, protojson.Unmarshal(b, &res), "%.500s", b)
	require.Len(t, res.GetResults(), len(req.GetItems()))
	return &res
}

// itemError is a Batch item's error, with its ErrorInfo's reason.
func itemError(t *testing.T, r *idemregv1.BatchItemResult) (*status.Status, string) {
	t.Helper()
	require.NotNil(t, r.GetError(), "an error: %v", r)
	st := status.FromProto(r.GetError())
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return st, info.GetReason()
		}
	}
	t.Fatalf("no ErrorInfo in %v", st)
	return nil, ""
}

// violated lists the fields of st's BadRequest.
func violated(st *status.Status) []string {
	var out []string
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				out = append(out, v.GetField())
			}
		}
	}
	return out
}

// TestHTTPAPIBatch: Batch over JSON answers per item as over gRPC: a Claim
// acquired, a Complete of it stored, a Complete with a forged secret, an
// item of a consumer the identity may not use, and an item that is neither
// a claim nor a complete, each its own status; a batch over the bounds is
// a 400 as a whole, and a body that does not decode is a 4xx, never a 500.
func TestHTTPAPIBatch(t *testing.T) {
	s := startAPI(t, 0)
	claim := func(consumer, key string) *idemregv1.BatchItem {
		return &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key}}}
	}
	complete := func(key string, token int64, secret []byte, data string) *idemregv1.BatchItem {
		return &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Complete{Complete: &idemregv1.CompleteRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: key, Token: token, ClaimSecret: secret, Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "test.Reply", Data: []byte(data)}}}}}}
	}
	forged := bytes.Repeat([]byte{0xA5}, server.ClaimSecretSize)

	first := s.batchJSON(t, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
		claim("billing.worker", "k1"),
		claim("ledger.worker", "k1"), // not this identity's
		{},                           // neither
		complete("k0", 1, forged, "x"),
	}})
	acquired := first.GetResults()[0].GetClaim()
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, acquired.GetOutcome(), "%v", first.GetResults()[0])
	st, why := itemError(t, first.GetResults()[1])
	require.Equal(t, codes.PermissionDenied, st.Code())
	require.Equal(t, idemregv1.ReasonPermissionDenied, why)
	st, why = itemError(t, first.GetResults()[2])
	require.Equal(t, codes.InvalidArgument, st.Code())
	require.Equal(t, idemregv1.ReasonInvalidArgument, why)
	_, why = itemError(t, first.GetResults()[3])
	require.Equal(t, idemregv1.ReasonClaimSecretInvalid, why)

	// The Complete of the claim, then a Claim of its key: a replay.
	second := s.batchJSON(t, &idemregv1.BatchRequest{Items: []*idemregv1.BatchItem{
		complete("k1", acquired.GetToken(), acquired.GetClaimSecret(), "stored"),
		claim("billing.worker", "k1"),
	}})
	require.Equal(t, idemregv1.State_STATE_COMPLETED, second.GetResults()[0].GetComplete().GetRecord().GetState(), "%v", second.GetResults()[0])
	replay := second.GetResults()[1].GetClaim()
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	require.Equal(t, "stored", string(replay.GetRecord().GetResult().GetResponse().GetData()))

	// Bounds, as over gRPC: refused whole.
	many := &idemregv1.BatchRequest{}
	for i := range server.MaxBatchItems + 1 {
		many.Items = append(many.Items, claim("billing.worker", fmt.Sprint("many-", i)))
	}
	big := &idemregv1.BatchRequest{}
	for i := range 5 {
		big.Items = append(big.Items, complete(fmt.Sprint("big-", i), 1, forged, strings.Repeat("d", 900<<10)))
	}
	for name, req := range map[string]*idemregv1.BatchRequest{"empty": {}, "501 items": many, "4.5 MiB": big} {
		t.Run(name, func(t *testing.T) {
			body, err := protojson.Marshal(req)
			require.NoError(t, err)
			code, b := s.postJSON(t, "Batch", body)
			require.Equal(t, http.StatusBadRequest, code, "%.300s", b)
			var ce struct{ Code string }
			require.NoError(t, json.Unmarshal(b, &ce))
			require.Equal(t, "invalid_argument", ce.Code)
		})
	}
	looked, err := protojson.Marshal(&idemregv1.LookupRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "many-0"})
	require.NoError(t, err)
	code, _ := s.postJSON(t, "Lookup", looked)
	require.Equal(t, http.StatusNotFound, code, "nothing of a refused batch is decided")

	// Bodies that do not decode into a BatchRequest.
	for _, body := range []string{
		`{"items":`,
		`{"items":"x"}`,
		`{"items":{}}`,
		`{"items":[1]}`,
		`{"items":[null]}`,
		`{"items":[{"claim":{},"complete":{}}]}`,
		`{"items":[{"claim":{"consumer":7}}]}`,
		`{"items":[{"claim":{"key":"k","lease":"forever"}}]}`,
		`{"items":[{"complete":{"token":"x"}}]}`,
		`[]`,
		`null`,
	} {
		t.Run(body, func(t *testing.T) {
			code, b := s.postJSON(t, "Batch", []byte(body))
			require.GreaterOrEqual(t, code, 400, "%.300s", b)
			require.Less(t, code, 500, "%.300s", b)
		})
	}
	// An item whose oneof is null, or of a kind this server does not know
	// (a field the API discards, as a newer client's): an item with none,
	// answered alone.
	code, b := s.postJSON(t, "Batch", []byte(`{"items":[{"claim":null},{"batch":{}},{"claim":{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"k2"}}]}`))
	require.Equal(t, http.StatusOK, code, "%.300s", b)
	var res idemregv1.BatchResponse
	require.NoError(t, protojson.Unmarshal(b, &res))
	for i := range 2 {
		st, _ = itemError(t, res.GetResults()[i])
		require.Equal(t, codes.InvalidArgument, st.Code())
		require.Equal(t, []string{fmt.Sprintf("items[%d]", i)}, violated(st))
	}
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetResults()[2].GetClaim().GetOutcome())

	var batches int
	for _, line := range s.logs.finished(t) {
		require.NotEqual(t, "INTERNAL", line["grpc.code"], "%v", line)
		if line["grpc.method"] == "Batch" {
			batches++
		}
	}
	require.Positive(t, batches, "the access log names the method")
}
