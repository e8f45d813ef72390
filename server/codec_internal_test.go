package server

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// codecMessages are the requests the server decodes, one per message type.
var codecMessages = []func() proto.Message{
	func() proto.Message { return &idemregv1.ClaimRequest{} },
	func() proto.Message { return &idemregv1.CompleteRequest{} },
	func() proto.Message { return &idemregv1.ReleaseRequest{} },
	func() proto.Message { return &idemregv1.ExtendRequest{} },
	func() proto.Message { return &idemregv1.LookupRequest{} },
	func() proto.Message { return &idemregv1.InspectRecordRequest{} },
	func() proto.Message { return &idemregv1.InvalidateRecordRequest{} },
	func() proto.Message { return &healthpb.HealthCheckRequest{} },
	func() proto.Message { return &reflectionpb.ServerReflectionRequest{} },
}

// countingPool counts the buffers it lent that have not come back.
type countingPool struct{ out atomic.Int64 }

func (p *countingPool) Get(n int) *[]byte {
	p.out.Add(1)
	b := make([]byte, n)
	return &b
}

func (p *countingPool) Put(*[]byte) { p.out.Add(-1) }

// FuzzRequestCodec decodes arbitrary bytes, split across two buffers as
// gRPC may hand them over, as each request message the server serves, the
// way the server does (requestCodec, then rawRequest.decode). The protobuf
// runtime is the oracle: bytes it decodes give the same message; bytes it
// refuses are INVALID_ARGUMENT with reason MALFORMED_REQUEST and an empty
// message, never INTERNAL and never a panic; and every buffer is returned.
func FuzzRequestCodec(f *testing.F) {
	claim, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1", Fingerprint: []byte("fp")})
	require.NoError(f, err)
	f.Add(uint8(0), claim, uint16(3))
	f.Add(uint8(4), []byte{0x1a, 100, 'a', 'b'}, uint16(1)) // truncated field
	f.Add(uint8(1), []byte{0x20, 0x80}, uint16(0))          // unterminated varint
	f.Add(uint8(2), []byte{0x00, 0x01}, uint16(0))          // field number 0
	f.Add(uint8(8), []byte{}, uint16(0))
	marked := &idemregv1.ClaimRequest{}
	MarkMalformed(marked, "JSON: broken")
	markedBytes, err := proto.Marshal(marked)
	require.NoError(f, err)
	f.Add(uint8(0), append(claim, markedBytes...), uint16(5)) // a transcoder's mark
	codec := newRequestCodec()
	f.Fuzz(func(t *testing.T, which uint8, data []byte, split uint16) {
		newMsg := codecMessages[int(which)%len(codecMessages)]
		want := newMsg()
		wantErr := proto.Unmarshal(data, want)

		// Pooled buffers (their capacity is over gRPC's pooling threshold),
		// so that a missing or a second Free shows in the count.
		pool := &countingPool{}
		at := int(split) % (len(data) + 1)
		var in mem.BufferSlice
		for _, part := range [][]byte{data[:at], data[at:]} {
			b := pool.Get(len(part) + 4096)
			*b = append((*b)[:0], part...)
			in = append(in, mem.NewBuffer(b, pool))
		}
		var raw rawRequest
		require.NoError(t, codec.Unmarshal(in, &raw))
		in.Free() // as gRPC does once Unmarshal returns
		got := newMsg()
		err := raw.decode(got)
		require.Zero(t, pool.out.Load(), "every buffer is returned, once")

		// A request the protobuf runtime decodes is refused only when it
		// carries a transcoder's mark (MarkMalformed).
		_, hasMark := markOf(want.ProtoReflect().GetUnknown())
		if wantErr == nil && !hasMark {
			require.NoError(t, err)
			require.True(t, proto.Equal(want, got), "decoded as the protobuf runtime does")
			return
		}
		st := status.Convert(err)
		require.Equal(t, codes.InvalidArgument, st.Code(), "%v", err)
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			if i, ok := d.(*errdetails.ErrorInfo); ok {
				info = i
			}
		}
		require.NotNil(t, info)
		require.Equal(t, idemregv1.ReasonMalformedRequest, info.GetReason())
		require.Equal(t, string(got.ProtoReflect().Descriptor().FullName()), info.GetMetadata()["message"])
		require.Zero(t, proto.Size(got), "nothing half-decoded is left")
	})
}
