package server_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// TestMarkMalformed: a request a transcoder marked (server.MarkMalformed,
// what the HTTP API sends for JSON that does not decode) is refused by the
// server as a malformed request, INVALID_ARGUMENT with ErrorInfo
// MALFORMED_REQUEST naming the message, quoting at most
// MaxEchoedFieldBytes of the detail, whatever else it carries.
func TestMarkMalformed(t *testing.T) {
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{}))
	for _, text := range []string{"JSON: proto: unexpected EOF", "JSON: " + strings.Repeat("9", 1<<20)} {
		req := &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"}
		server.MarkMalformed(req, text)
		_, err := c.Claim(t.Context(), req)
		st := status.Convert(err)
		require.Equal(t, codes.InvalidArgument, st.Code(), "%v", err)
		info := detail[*errdetails.ErrorInfo](t, err)
		require.Equal(t, idemregv1.ReasonMalformedRequest, info.GetReason())
		require.Equal(t, "idemreg.v1.ClaimRequest", info.GetMetadata()["message"])
		require.Contains(t, st.Message(), text[:min(len(text), 32)])
		require.LessOrEqual(t, len(st.Message()), server.MaxStatusMessageBytes+32)
	}
}
