package client_test

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idemreg/idemreg/client"
)

// FuzzDefaultFingerprint fingerprints requests decoded from arbitrary
// bytes. A request is a google.protobuf.Struct: maps (whose encoding order
// is random unless deterministic), nesting, lists, floats. The fingerprint
// must fit the registry's 64-byte limit, never panic, and be the same for
// the same request however it was built or re-encoded (or a retry would
// see FINGERPRINT_MISMATCH), and differ between methods.
func FuzzDefaultFingerprint(f *testing.F) {
	seeds := []map[string]any{
		{"amount": 1200, "currency": "EUR", "account": "acct-1"},
		{"nested": map[string]any{"b": []any{1, "two", true, nil}, "a": 3.5}},
		{},
		{"z": "", "y": "", "x": "", "w": map[string]any{"k": map[string]any{}}},
	}
	for _, m := range seeds {
		s, err := structpb.NewStruct(m)
		if err != nil {
			f.Fatal(err)
		}
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add("/payments.v1.PaymentService/Charge", b)
	}
	f.Add("", []byte{0x0a, 0x00})
	f.Add("/\x00", []byte{0x0a, 0x03, 0x0a, 0x01, 0xff}) // invalid UTF-8 in a map key
	f.Add("/a/b", []byte{0xfa, 0xff, 0xff, 0xff, 0x0f, 0x00})

	f.Fuzz(func(t *testing.T, method string, raw []byte) {
		var req structpb.Struct
		if proto.Unmarshal(raw, &req) != nil {
			return // gRPC would not have decoded it either
		}
		fp, err := client.DefaultFingerprint(method, &req)
		if err != nil {
			t.Fatal(err)
		}
		if len(fp) == 0 || len(fp) > 64 {
			t.Fatalf("a fingerprint of %d bytes: the registry refuses an empty one and one over 64 bytes", len(fp))
		}

		again, err := client.DefaultFingerprint(method, proto.Clone(&req))
		if err != nil || !bytes.Equal(again, fp) {
			t.Fatalf("a clone: %q, %v; want %q", again, err, fp)
		}

		// A retry after a restart decodes the request afresh from an
		// encoding whose map order may differ.
		for range 3 {
			b, err := proto.MarshalOptions{Deterministic: false}.Marshal(&req)
			if err != nil {
				t.Fatal(err)
			}
			var decoded structpb.Struct
			if err := proto.Unmarshal(b, &decoded); err != nil {
				t.Fatal(err)
			}
			again, err = client.DefaultFingerprint(method, &decoded)
			if err != nil || !bytes.Equal(again, fp) {
				t.Fatalf("the same request re-encoded: %q, %v; want %q", again, err, fp)
			}
		}

		other, err := client.DefaultFingerprint(method+"x", &req)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(other, fp) {
			t.Fatalf("another method, the same fingerprint %q", fp)
		}
	})
}
