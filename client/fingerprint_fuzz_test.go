package client_test

import (
	"testing"

	"github.com/stretchr/testify/require"
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
		require.NoError(f, err)
		b, err := proto.Marshal(s)
		require.NoError(f, err)
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
		require.NoError(t, err)
		require.NotEmpty(t, fp)
		require.LessOrEqual(t, len(fp), 64, "the registry refuses fingerprints over 64 bytes")

		again, err := client.DefaultFingerprint(method, proto.Clone(&req))
		require.NoError(t, err)
		require.Equal(t, fp, again, "a clone")

		// A retry after a restart decodes the request afresh from an
		// encoding whose map order may differ.
		for range 3 {
			b, err := proto.MarshalOptions{Deterministic: false}.Marshal(&req)
			require.NoError(t, err)
			var decoded structpb.Struct
			require.NoError(t, proto.Unmarshal(b, &decoded))
			again, err = client.DefaultFingerprint(method, &decoded)
			require.NoError(t, err)
			require.Equal(t, fp, again, "the same request re-encoded")
		}

		other, err := client.DefaultFingerprint(method+"x", &req)
		require.NoError(t, err)
		require.NotEqual(t, fp, other, "another method")
	})
}
