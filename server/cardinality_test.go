package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
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
// with no request message, is the caller's malformed request: its access
// log line is INFO, says MALFORMED_REQUEST, and is sampled like a refusal.
// Before, each was an unsampled ERROR line ("cardinality violation"), 300
// calls 300 lines. The code sent stays grpc-go's INTERNAL: grpc-go writes
// it in serverStream.RecvMsg (stream.go), before it returns to any handler
// (docs/operations.md, "Threat model and limits").
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
		require.NotEqual(t, codes.OK, codesOf[id])
	}
	lines := logs.waitLines(t, "finished call", 1)
	require.Less(t, len(lines), calls, "the lines are sampled")
	for _, line := range lines {
		require.Equal(t, "INFO", line["level"], "%v", line)
		require.Equal(t, idemregv1.ReasonMalformedRequest, line["reason"], "%v", line)
	}
}
