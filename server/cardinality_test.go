package server_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/emptypb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
)

// openEnded starts a call of method whose HEADERS end the stream: a call
// with no request message.
func (p *rawPeer) openEnded(t *testing.T, method string) uint32 {
	t.Helper()
	var block []byte
	enc := hpack.NewEncoder(&appendWriter{&block})
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "idemreg"},
		{"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
	}
	id := p.next
	p.next += 2
	require.NoError(t, p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block, EndHeaders: true, EndStream: true}))
	return id
}

// TestNoRequestMessage: an HTTP/2 stream whose HEADERS end it, a unary call
// with no request message, is the caller's malformed request: answered
// INVALID_ARGUMENT, reason MALFORMED_REQUEST, by the server's own chain,
// its access log line INFO and sampled like a refusal. Registered as unary
// methods, grpc-go answered each INTERNAL ("cardinality violation") before
// any handler ran, and each was an unsampled ERROR line, 300 calls 300
// lines.
func TestNoRequestMessage(t *testing.T) {
	const rate, calls = 3, 60
	var logs syncBuffer
	addr, _ := servertest.Serve(t, memStore(t), server.Config{Logger: jsonLogger(&logs), RefusalLogRate: rate})
	p := dialRaw(t, addr)
	var ids []uint32
	for range calls {
		ids = append(ids, p.openEnded(t, "/idemreg.v1.RegistryService/Claim"))
	}
	answers, codesOf := p.await(ids)
	for _, id := range ids {
		require.Equal(t, answerGRPCError, answers[id], "stream %d", id)
		require.Equal(t, codes.InvalidArgument, codesOf[id], "stream %d", id)
	}
	lines := logs.waitLines(t, "finished call", 1)
	require.Less(t, len(lines), calls, "the lines are sampled")
	for _, line := range lines {
		require.Equal(t, "INFO", line["level"], "%v", line)
		require.Equal(t, "INVALID_ARGUMENT", line["grpc.code"], "%v", line)
	}
}

// TestOneRequestMessage: a unary method's call with no message, or two, is
// refused INVALID_ARGUMENT with ErrorInfo MALFORMED_REQUEST naming the
// request's message, after authentication (a caller without credentials
// learns nothing more than UNAUTHENTICATED), on the main listener and the
// health listener alike, and so is a server stream's (health's Watch); a
// call with one message is served as before.
func TestOneRequestMessage(t *testing.T) {
	const token = "orders-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: orders
    token_hashes: ["`+access.HashToken(token)+`"]
    consumers: ["orders.*"]
`)
	addr, srv := servertest.Serve(t, memStore(t), server.Config{Access: src})
	conn := servertest.Dial(t, addr)
	authed := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	claim := &idemregv1.ClaimRequest{Consumer: "orders.inbox", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1", Lease: durationpb.New(time.Minute)}
	call := func(ctx context.Context, conn *grpc.ClientConn, method string, msgs ...proto.Message) (proto.Message, error) {
		st, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, method)
		require.NoError(t, err)
		for _, m := range msgs {
			require.NoError(t, st.SendMsg(m))
		}
		require.NoError(t, st.CloseSend())
		var reply emptypb.Empty
		return &reply, st.RecvMsg(&reply)
	}
	const claimMethod = "/idemreg.v1.RegistryService/Claim"

	_, err := call(authed, conn, claimMethod)
	st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	require.Contains(t, st.Message(), "no request message")
	require.Contains(t, st.Message(), "idemreg.v1.ClaimRequest")

	_, err = call(authed, conn, claimMethod, claim, claim)
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	require.Contains(t, st.Message(), "more than one request message")

	_, err = call(t.Context(), conn, claimMethod)
	requireStatus(t, err, codes.Unauthenticated, idemregv1.ReasonUnauthenticated)

	// One message: served, and nothing was claimed before.
	res, err := idemregv1.NewRegistryServiceClient(conn).Claim(authed, claim)
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())

	// A server stream's one request message, the same.
	_, err = call(t.Context(), conn, "/grpc.health.v1.Health/Watch")
	requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	watch, err := healthpb.NewHealthClient(conn).Watch(t.Context(), &healthpb.HealthCheckRequest{Service: server.LivenessService})
	require.NoError(t, err)
	first, err := watch.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, first.GetStatus())

	// The health listener carries its Check the same way.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.ServeHealth(lis) }()
	hconn := servertest.Dial(t, lis.Addr().String())
	_, err = call(t.Context(), hconn, "/grpc.health.v1.Health/Check")
	requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	hres, err := healthpb.NewHealthClient(hconn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: server.LivenessService})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, hres.GetStatus())
}
