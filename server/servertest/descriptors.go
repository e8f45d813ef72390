package servertest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
)

// ChargeResponse is the full name of the message of ChargeDescriptorSet.
const ChargeResponse = "payments.v1.ChargeResponse"

// ChargeDescriptorSet is the descriptor set of examples/proto/payments/v1's
// ChargeResponse, as `buf build` writes it: a type of an operator's
// service that the registry's binary does not link. It is written out
// here, not compiled, because the examples are a module of their own that
// the registry does not require.
func ChargeDescriptorSet() *descriptorpb.FileDescriptorSet {
	field := func(name string, n int32, typ descriptorpb.FieldDescriptorProto_Type, json string) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n), Type: typ.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String(json)}
	}
	str, i64 := descriptorpb.FieldDescriptorProto_TYPE_STRING, descriptorpb.FieldDescriptorProto_TYPE_INT64
	return &descriptorpb.FileDescriptorSet{File: []*descriptorpb.FileDescriptorProto{{
		Name:    proto.String("payments/v1/payments.proto"),
		Package: proto.String("payments.v1"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("ChargeResponse"),
			Field: []*descriptorpb.FieldDescriptorProto{
				field("charge_id", 1, str, "chargeId"), field("account", 2, str, "account"),
				field("amount_minor", 3, i64, "amountMinor"), field("currency", 4, str, "currency"),
			},
		}},
	}}}
}

// WriteDescriptorSet writes set to a file of the test's, in the binary
// form --descriptor-set reads, and returns its path.
func WriteDescriptorSet(t testing.TB, set *descriptorpb.FileDescriptorSet) string {
	t.Helper()
	b, err := proto.Marshal(set)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "descriptors.binpb")
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}
