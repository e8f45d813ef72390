package server_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
)

// maxLogLineBytes bounds a log line of a refused call: a handful of fields,
// each at most MaxEchoedFieldBytes, and a status message of at most
// MaxStatusMessageBytes (docs/operations.md, "Log and error bounds").
const maxLogLineBytes = 4 << 10

// markerBytes is room for the "…(+N bytes)" a cut field ends with.
const markerBytes = len("…(+1048576 bytes)")

// TestLogAndErrorBounds sends a consumer of 1 MiB through each place that
// quotes it before validation bounds it (authentication, authorization, the
// rate limit, validation) to a real server: every log line stays under
// maxLogLineBytes, every status message under MaxStatusMessageBytes, every
// ErrorInfo metadata value and QuotaFailure subject under
// MaxEchoedFieldBytes, each with the marker that says it was cut.
func TestLogAndErrorBounds(t *testing.T) {
	const token = "bounds-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: billing
    token_hashes: ["`+access.HashToken(token)+`"]
    consumers: ["billing.*"]
rate_limits:
  - consumers: ["billing.*"]
    rate: 0.001
    burst: 1
`)
	var logs syncBuffer
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src, Logger: jsonLogger(&logs)}))
	authenticated := func(ctx context.Context) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	huge := func(prefix string) string { return prefix + strings.Repeat("x", 1<<20-len(prefix)) }
	cases := []struct {
		name     string
		ctx      func(context.Context) context.Context
		consumer string
		code     codes.Code
		reason   string
	}{
		{"unauthenticated", func(ctx context.Context) context.Context { return ctx }, huge("orders."), codes.Unauthenticated, idemregv1.ReasonUnauthenticated},
		{"authenticated but refused", authenticated, huge("orders."), codes.PermissionDenied, idemregv1.ReasonPermissionDenied},
		// The first call of the bucket reaches validation, the second the limit.
		{"granted, invalid", authenticated, huge("billing."), codes.InvalidArgument, idemregv1.ReasonInvalidArgument},
		{"granted, rate limited", authenticated, huge("billing."), codes.ResourceExhausted, idemregv1.ReasonRateLimited},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(logs.lines(t, "finished call"))
			_, err := c.Claim(tc.ctx(t.Context()), &idemregv1.ClaimRequest{Consumer: tc.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
			st := requireStatus(t, err, tc.code, tc.reason)
			require.LessOrEqual(t, len(st.Message()), server.MaxStatusMessageBytes+markerBytes, "status message")
			require.Less(t, proto.Size(st.Proto()), maxLogLineBytes, "the whole status, details included")
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.ErrorInfo:
					for k, v := range d.GetMetadata() {
						require.LessOrEqual(t, len(v), server.MaxEchoedFieldBytes+markerBytes, "ErrorInfo metadata %s", k)
					}
					if v, ok := d.GetMetadata()["consumer"]; ok {
						require.Equal(t, tc.consumer[:server.MaxEchoedFieldBytes]+"…(+1048320 bytes)", v, "cut, and says by how much")
					}
				case *errdetails.QuotaFailure:
					require.Equal(t, "consumer:"+tc.consumer[:server.MaxEchoedFieldBytes]+"…(+1048320 bytes)", d.GetViolations()[0].GetSubject())
				case *errdetails.BadRequest:
					for _, v := range d.GetFieldViolations() {
						require.LessOrEqual(t, len(v.GetDescription()), server.MaxStatusMessageBytes+markerBytes)
					}
				}
			}
			calls := logs.waitLines(t, "finished call", before+1)
			require.Len(t, calls, before+1, "one line for the call")
			line := calls[len(calls)-1]
			require.Equal(t, rpccode.Code(tc.code).String(), line["grpc.code"])
			require.Equal(t, tc.consumer[:server.MaxEchoedFieldBytes]+"…(+1048320 bytes)", line["consumer"])
			require.Equal(t, status.Convert(err).Message(), line["grpc.error"], "the status message as sent")
		})
	}
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		require.Less(t, len(line), maxLogLineBytes, "log line %.200s…", line)
	}
}
