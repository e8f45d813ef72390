package client_test

import (
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

var updateVectors = flag.Bool("update-fingerprints", false, "rewrite testdata/fingerprints.json from the cases in TestFingerprintVectors")

// fingerprintVector is one line of testdata/fingerprints.json, the
// vectors every client's DefaultFingerprint is checked against (the
// Python client's tests read the same file), so that a Go producer and a
// consumer in another language fingerprint one request alike.
type fingerprintVector struct {
	Name   string `json:"name"`
	Method string `json:"method"`
	// Type is the request's full protobuf name; Message its encoding, not
	// the deterministic one (map entries in the order Go's map gave), so
	// that a client must re-encode it to fingerprint it.
	Type        string `json:"type"`
	Message     string `json:"message_hex"`
	Fingerprint string `json:"fingerprint_hex"`
}

const vectorsFile = "testdata/fingerprints.json"

// TestFingerprintVectors checks DefaultFingerprint against the shared
// vectors, and the vectors against the cases below; go test
// -run TestFingerprintVectors -update-fingerprints rewrites the file.
func TestFingerprintVectors(t *testing.T) {
	cases := []struct {
		name, method string
		msg          proto.Message
	}{
		{"an empty struct", "/payments.v1.PaymentService/Charge", mustStruct(t, map[string]any{})},
		{"a payment", "/payments.v1.PaymentService/Charge", mustStruct(t, map[string]any{
			"amount": 1200, "currency": "EUR", "account": "acct-1", "capture": true,
		})},
		{"map keys in code point order, nested and non-ASCII", "/a.B/C", mustStruct(t, map[string]any{
			"z": "", "é": "accent", "Z": 1.5, "a": map[string]any{"y": []any{1, "two", true, nil}, "b": -0.25},
			"日本": map[string]any{}, "": "empty key",
		})},
		{"a claim request", "/idemreg.v1.RegistryService/Claim", &idemregv1.ClaimRequest{
			Consumer: "billing.payments", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "msg-42",
			Fingerprint: []byte{0, 1, 2, 0xff}, Lease: durationpb.New(30 * time.Second), RequestId: "R",
		}},
		{"a method name with non-ASCII, and no fields set", "/ü.Service/Méthode", &idemregv1.LookupRequest{}},
	}
	var want []fingerprintVector
	for _, c := range cases {
		b, err := proto.Marshal(c.msg)
		checkVector(t, err)
		fp, err := client.DefaultFingerprint(c.method, c.msg)
		checkVector(t, err)
		want = append(want, fingerprintVector{
			Name: c.name, Method: c.method, Type: string(c.msg.ProtoReflect().Descriptor().FullName()),
			Message: hex.EncodeToString(b), Fingerprint: hex.EncodeToString(fp),
		})
	}
	if *updateVectors {
		out, err := json.MarshalIndent(want, "", "  ")
		checkVector(t, err)
		checkVector(t, os.WriteFile(vectorsFile, append(out, '\n'), 0o644))
	}

	raw, err := os.ReadFile(vectorsFile)
	checkVector(t, err)
	var got []fingerprintVector
	checkVector(t, json.Unmarshal(raw, &got))
	if len(got) != len(cases) {
		t.Fatalf("%s has %d cases, the test %d (-update-fingerprints)", vectorsFile, len(got), len(cases))
	}
	for i, v := range got {
		t.Run(v.Name, func(t *testing.T) {
			if v.Name != want[i].Name || v.Fingerprint != want[i].Fingerprint {
				t.Fatalf("the file's case %d is %q with %s; the test's %q with %s", i, v.Name, v.Fingerprint, want[i].Name, want[i].Fingerprint)
			}
			mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(v.Type))
			checkVector(t, err)
			b, err := hex.DecodeString(v.Message)
			checkVector(t, err)
			m := mt.New().Interface()
			checkVector(t, proto.Unmarshal(b, m))
			fp, err := client.DefaultFingerprint(v.Method, m)
			checkVector(t, err)
			if got := hex.EncodeToString(fp); got != v.Fingerprint {
				t.Fatalf("DefaultFingerprint of the decoded message: %s; want %s", got, v.Fingerprint)
			}
		})
	}
}

func mustStruct(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	checkVector(t, err)
	return s
}

func checkVector(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
