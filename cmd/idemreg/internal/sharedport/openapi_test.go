package sharedport

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	_ "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// openAPIDir holds the OpenAPI document and the examples it is made from
// (docs/openapi/README.md).
const openAPIDir = "../../../../docs/openapi/"

// exampleOrder is the order TestOpenAPIExamples sends the examples in, so
// that each finds the records the ones before it made (a Lookup the
// Claim's and Complete's key, an InspectRecord the Park's).
var exampleOrder = []string{
	"idemreg.v1.RegistryService/Claim",
	"idemreg.v1.RegistryService/Complete",
	"idemreg.v1.RegistryService/Lookup",
	"idemreg.v1.RegistryService/Extend",
	"idemreg.v1.RegistryService/Release",
	"idemreg.v1.RegistryService/Park",
	"idemreg.v1.RegistryService/BatchClaim",
	"idemreg.v1.RegistryService/BatchComplete",
	"idemreg.v1.RegistryService/Batch",
	"idemreg.v1.AdminService/CountParked",
	"idemreg.v1.AdminService/ListRecords",
	"idemreg.v1.AdminService/InspectRecord",
	"idemreg.v1.AdminService/ResolveRecord",
	"idemreg.v1.AdminService/InvalidateRecord",
	"idemreg.v1.AdminService/BeginBackup",
	"idemreg.v1.AdminService/ReadBackup",
	"idemreg.v1.AdminService/EndBackup",
}

// notSent are the examples only decoded, not sent: the backup calls need
// a store on disk and a backup in progress, and are exercised against
// real servers by server's TestBackupRPCs and backupcmd's tests.
var notSent = map[string]bool{
	"idemreg.v1.AdminService/BeginBackup": true,
	"idemreg.v1.AdminService/ReadBackup":  true,
	"idemreg.v1.AdminService/EndBackup":   true,
}

// TestOpenAPIExamples sends every example request of the OpenAPI
// document, in the document's JSON, to a real server's HTTP API, and holds
// each example answer to the server's: every method has one; each
// request and answer decodes strictly into its message; the server
// answers 200 with the same fields, recursively, and the same outcome,
// state and end. A token and claimSecret in a request are the ones the
// server gave for its key (a Claim's, made first when none did): the
// examples' own are the shape, not values a server would accept.
func TestOpenAPIExamples(t *testing.T) {
	raw, err := os.ReadFile(openAPIDir + "examples.json")
	require.NoError(t, err)
	var examples map[string]struct {
		Summary           string
		Request, Response json.RawMessage
	}
	require.NoError(t, json.Unmarshal(raw, &examples))
	names := make([]string, 0, len(examples))
	for n := range examples {
		names = append(names, n)
	}
	sort.Strings(names)
	want := slices.Clone(exampleOrder)
	sort.Strings(want)
	require.Equal(t, want, names, "exampleOrder names every example, once")
	for _, svc := range []protoreflect.FullName{"idemreg.v1.RegistryService", "idemreg.v1.AdminService"} {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(svc)
		require.NoError(t, err)
		methods := d.(protoreflect.ServiceDescriptor).Methods()
		for i := range methods.Len() {
			require.Contains(t, examples, string(svc)+"/"+string(methods.Get(i).Name()), "every method has an example")
		}
	}

	s := startAPIWith(t, func(c *server.Config) { c.Access = nil })
	held := map[string]claimed{} // by consumer/kind/key
	for _, name := range exampleOrder {
		ex := examples[name]
		method := methodOf(t, name)
		decodeStrict(t, name+" request", ex.Request, method.Input())
		decodeStrict(t, name+" response", ex.Response, method.Output())
		if notSent[name] {
			continue
		}

		var req any
		require.NoError(t, json.Unmarshal(ex.Request, &req))
		fillClaims(t, s, req, held)
		body, err := json.Marshal(req)
		require.NoError(t, err)
		code, got := s.postPlain(t, name, body)
		require.Equal(t, http.StatusOK, code, "%s: %s", name, got)
		t.Logf("%s answered %s", name, got)
		var gotJSON, wantJSON any
		require.NoError(t, json.Unmarshal(got, &gotJSON))
		require.NoError(t, json.Unmarshal(ex.Response, &wantJSON))
		sameShape(t, name, "", wantJSON, gotJSON)
		remember(gotJSON, held)
	}
}

// claimed is what a Claim's answer gave for a key.
type claimed struct {
	token  string
	secret string
}

func recordID(o map[string]any) string {
	return str(o["consumer"]) + "/" + str(o["kind"]) + "/" + str(o["key"])
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

// remember keeps the tokens and claim secrets an answer carries, wherever
// in it a record is.
func remember(v any, held map[string]claimed) {
	switch v := v.(type) {
	case map[string]any:
		if rec, ok := v["record"].(map[string]any); ok {
			c := held[recordID(rec)]
			c.token = str(rec["token"])
			if sec := str(v["claimSecret"]); sec != "" {
				c.secret = sec
			}
			held[recordID(rec)] = c
		}
		for _, x := range v {
			remember(x, held)
		}
	case []any:
		for _, x := range v {
			remember(x, held)
		}
	}
}

// fillClaims puts into each object of a request that has a token the token
// and claim secret the server gave for its key, claiming the key first
// when it gave none.
func fillClaims(t *testing.T, s *apiServer, v any, held map[string]claimed) {
	switch v := v.(type) {
	case map[string]any:
		if _, ok := v["token"]; ok && v["key"] != nil {
			id := recordID(v)
			c, ok := held[id]
			if !ok {
				body, err := json.Marshal(map[string]any{"consumer": v["consumer"], "kind": v["kind"], "key": v["key"], "lease": "30s"})
				require.NoError(t, err)
				code, got := s.postPlain(t, "idemreg.v1.RegistryService/Claim", body)
				require.Equal(t, http.StatusOK, code, "%s", got)
				var ans any
				require.NoError(t, json.Unmarshal(got, &ans))
				remember(ans, held)
				c = held[id]
				require.NotEmpty(t, c.secret, "a fresh key is acquired: %s", got)
			}
			v["token"] = c.token
			if _, ok := v["claimSecret"]; ok {
				v["claimSecret"] = c.secret
			}
		}
		for _, x := range v {
			fillClaims(t, s, x, held)
		}
	case []any:
		for _, x := range v {
			fillClaims(t, s, x, held)
		}
	}
}

// sameShape requires got to have want's fields, recursively, no more and
// no fewer, and want's outcome, state and end.
func sameShape(t *testing.T, method, path string, want, got any) {
	t.Helper()
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		require.True(t, ok, "%s: %s: an object in the example, %T in the answer", method, path, got)
		require.ElementsMatch(t, keys(w), keys(g), "%s: %s: the example's fields and the answer's", method, path)
		for k, wv := range w {
			if k == "outcome" || k == "state" || k == "end" {
				require.Equal(t, wv, g[k], "%s: %s.%s", method, path, k)
			}
			sameShape(t, method, path+"."+k, wv, g[k])
		}
	case []any:
		g, ok := got.([]any)
		require.True(t, ok, "%s: %s: an array in the example, %T in the answer", method, path, got)
		require.Len(t, g, len(w), "%s: %s", method, path)
		for i := range w {
			sameShape(t, method, path+"[]", w[i], g[i])
		}
	}
}

func keys(m map[string]any) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func methodOf(t *testing.T, name string) protoreflect.MethodDescriptor {
	t.Helper()
	svc, m, ok := strings.Cut(name, "/")
	require.True(t, ok, name)
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	require.NoError(t, err, name)
	md := d.(protoreflect.ServiceDescriptor).Methods().ByName(protoreflect.Name(m))
	require.NotNil(t, md, name)
	return md
}

// decodeStrict decodes an example as the server does, refusing an unknown
// field.
func decodeStrict(t *testing.T, what string, raw []byte, md protoreflect.MessageDescriptor) {
	t.Helper()
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName())
	require.NoError(t, err)
	m := mt.New().Interface()
	require.NoError(t, protojson.Unmarshal(raw, m), "%s: %s", what, raw)
}

// postPlain POSTs body as plain JSON (no Connect header, as curl sends it)
// to a method, /package.Service/Method.
func (s *apiServer) postPlain(t *testing.T, name string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.base+"/"+name, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, b
}

// TestOpenAPIErrorExample holds the document's error example
// (ConnectError's) and its mapping's claims to a real server's answers: a
// Complete under a token another holder replaced is the example's error,
// field for field, code and reason; a field the message does not have is
// ignored; a value of the wrong type is a 400, MALFORMED_REQUEST.
func TestOpenAPIErrorExample(t *testing.T) {
	raw, err := os.ReadFile(openAPIDir + "idemreg.openapi.json")
	require.NoError(t, err)
	var doc struct {
		Components struct {
			Schemas map[string]struct {
				Example map[string]any
			}
		}
	}
	require.NoError(t, json.Unmarshal(raw, &doc))
	want := doc.Components.Schemas["ConnectError"].Example
	require.NotEmpty(t, want)

	s := startAPIWith(t, func(c *server.Config) { c.Access = nil })
	claim := []byte(`{"consumer":"billing.payments","kind":"KIND_MESSAGE","key":"msg-err","lease":"30s"}`)
	code, first := s.postPlain(t, "idemreg.v1.RegistryService/Claim", claim)
	require.Equal(t, http.StatusOK, code, "%s", first)
	var ans map[string]any
	require.NoError(t, json.Unmarshal(first, &ans))
	// The holder gives the key back and another takes it: the first
	// token is stale.
	release, err := json.Marshal(map[string]any{"consumer": "billing.payments", "kind": "KIND_MESSAGE", "key": "msg-err",
		"token": ans["token"], "claimSecret": ans["claimSecret"]})
	require.NoError(t, err)
	code, got := s.postPlain(t, "idemreg.v1.RegistryService/Release", release)
	require.Equal(t, http.StatusOK, code, "%s", got)
	code, got = s.postPlain(t, "idemreg.v1.RegistryService/Claim", claim)
	require.Equal(t, http.StatusOK, code, "%s", got)
	require.Contains(t, string(got), "OUTCOME_ACQUIRED")
	complete, err := json.Marshal(map[string]any{"consumer": "billing.payments", "kind": "KIND_MESSAGE", "key": "msg-err",
		"token": ans["token"], "claimSecret": ans["claimSecret"], "result": map[string]any{"response": map[string]any{"type": "t"}}})
	require.NoError(t, err)
	code, got = s.postPlain(t, "idemreg.v1.RegistryService/Complete", complete)
	t.Logf("Complete under a stale token answered %d %s", code, got)
	require.Equal(t, http.StatusBadRequest, code, "failed_precondition is a 400")
	var gotJSON map[string]any
	require.NoError(t, json.Unmarshal(got, &gotJSON))
	require.Equal(t, want["code"], gotJSON["code"])
	sameShape(t, "Complete", "", any(want), any(gotJSON))
	wd := want["details"].([]any)[0].(map[string]any)
	gd := gotJSON["details"].([]any)[0].(map[string]any)
	require.Equal(t, wd["type"], gd["type"])
	require.Equal(t, wd["debug"], gd["debug"])

	code, got = s.postPlain(t, "idemreg.v1.RegistryService/Lookup", []byte(`{"consumer":"billing.payments","kind":"KIND_MESSAGE","key":"msg-err","nosuchField":1}`))
	require.Equal(t, http.StatusOK, code, "an unknown field is ignored: %s", got)
	code, got = s.postPlain(t, "idemreg.v1.RegistryService/Lookup", []byte(`{"consumer":"billing.payments","kind":"KIND_MESSAGE","key":7}`))
	t.Logf("a number for a string answered %d %s", code, got)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, string(got), "MALFORMED_REQUEST")
}
