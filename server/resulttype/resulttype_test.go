package resulttype_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/server/servertest"
)

func TestLinkedTypes(t *testing.T) {
	types := resulttype.Linked()
	want, err := proto.Marshal(wrapperspb.Int64(10))
	require.NoError(t, err)
	for _, json := range []string{`"10"`, `10`, `{"value":"10"}`, `{"value":10}`} {
		got, err := types.Encode("google.protobuf.Int64Value", json)
		require.NoError(t, err, json)
		require.Equal(t, want, got, "%s: a wrapper's JSON, or its message's", json)
	}
	_, err = types.Encode("google.protobuf.Int64Value", `{"value":10,"other":1}`)
	require.Error(t, err)
	_, err = types.Encode("payments.v1.Charge", `{}`)
	require.ErrorIs(t, err, resulttype.ErrUnknownType)

	known, err := types.Check("google.protobuf.Int64Value", []byte(`{"value":10}`))
	require.True(t, known)
	require.ErrorContains(t, err, "cannot parse invalid wire-format data", "the error the issue's replays got")
	known, err = types.Check("google.protobuf.Int64Value", want)
	require.True(t, known)
	require.NoError(t, err)
	known, err = types.Check("payments.v1.Charge", []byte("anything"))
	require.False(t, known, "a type that is not linked cannot be checked")
	require.NoError(t, err)
}

// TestDescriptorSet: a set's types are known beside the linked ones, its
// imports of linked files may be left out, and a file that is not a set
// is refused when loaded, not when first used.
func TestDescriptorSet(t *testing.T) {
	set := servertest.ChargeDescriptorSet()
	file := set.GetFile()[0]
	// As protoc writes it without --include_imports: timestamp.proto is
	// imported, not included.
	file.Dependency = []string{"google/protobuf/timestamp.proto"}
	file.MessageType[0].Field = append(file.MessageType[0].Field, &descriptorpb.FieldDescriptorProto{
		Name: proto.String("charged_at"), Number: proto.Int32(5), JsonName: proto.String("chargedAt"),
		Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Type: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum(),
		TypeName: proto.String(".google.protobuf.Timestamp"),
	})
	types, err := resulttype.Load(servertest.WriteDescriptorSet(t, set))
	require.NoError(t, err)
	data, err := types.Encode(servertest.ChargeResponse, `{"chargeId":"ch_1","chargedAt":"2026-01-02T03:04:05Z"}`)
	require.NoError(t, err)
	known, err := types.Check(servertest.ChargeResponse, data)
	require.True(t, known)
	require.NoError(t, err)
	known, err = types.Check(servertest.ChargeResponse, []byte("charge-1"))
	require.True(t, known)
	require.Error(t, err)
	_, ok := types.Find("google.protobuf.Int64Value")
	require.True(t, ok, "the linked types stay known")

	file.Dependency = []string{"payments/v1/money.proto"}
	_, err = resulttype.FromSet(set)
	require.ErrorContains(t, err, "--include_imports")

	notSet := filepath.Join(t.TempDir(), "payments.proto")
	require.NoError(t, os.WriteFile(notSet, []byte("syntax = \"proto3\";\n"), 0o600))
	_, err = resulttype.Load(notSet)
	require.ErrorContains(t, err, "not a binary FileDescriptorSet")
	_, err = resulttype.Load(filepath.Join(t.TempDir(), "none.binpb"))
	require.ErrorIs(t, err, os.ErrNotExist)
	linked, err := resulttype.Load("")
	require.NoError(t, err)
	_, ok = linked.Find(servertest.ChargeResponse)
	require.False(t, ok)
}
