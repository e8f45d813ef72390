package server_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/protobuf/proto"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
)

// malformed returns m with raw appended to its encoding: the client's
// codec sends unknown bytes as they are, so the server receives them.
func malformed[M proto.Message](m M, raw []byte) M {
	m.ProtoReflect().SetUnknown(raw)
	return m
}

// Encodings the protobuf runtime refuses.
var (
	truncatedField  = []byte{0x1a, 100, 'a', 'b'} // field 3, length 100, two bytes follow
	truncatedVarint = []byte{0x20, 0x80}          // field 4 (token), a varint that never ends
	fieldZero       = []byte{0x00, 0x01}          // field number 0 is not a field
)

// TestMalformedRequests sends requests that do not decode to a real
// server: each is INVALID_ARGUMENT with reason MALFORMED_REQUEST and the
// message's name (not INTERNAL, which the docs call a bug), leaves one
// access log line and is counted by otelgrpc under INVALID_ARGUMENT, like
// any refused call; an unknown caller gets UNAUTHENTICATED first; and the
// server goes on serving.
func TestMalformedRequests(t *testing.T) {
	const token = "codec-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: billing
    token_hashes: ["`+access.HashToken(token)+`"]
    consumers: ["billing.*"]
`)
	var logs syncBuffer
	reader := sdkmetric.NewManualReader()
	conn := start(t, memStore(t), server.Config{Access: src, Logger: jsonLogger(&logs),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	c := idemregv1.NewRegistryServiceClient(conn)
	admin := idemregv1.NewAdminServiceClient(conn)
	authenticated := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	cases := []struct {
		name     string
		call     func(ctx context.Context) error
		ctx      context.Context
		method   string
		code     codes.Code
		reason   string
		message  string // the ErrorInfo's "message"
		identity string // in the log line
	}{
		{"Lookup, truncated field", func(ctx context.Context) error {
			_, err := c.Lookup(ctx, malformed(&idemregv1.LookupRequest{}, truncatedField))
			return err
		}, authenticated, "Lookup", codes.InvalidArgument, idemregv1.ReasonMalformedRequest, "idemreg.v1.LookupRequest", "billing"},
		{"Complete, truncated varint after valid fields", func(ctx context.Context) error {
			_, err := c.Complete(ctx, malformed(&idemregv1.CompleteRequest{Consumer: "billing.worker", Key: "k"}, truncatedVarint))
			return err
		}, authenticated, "Complete", codes.InvalidArgument, idemregv1.ReasonMalformedRequest, "idemreg.v1.CompleteRequest", "billing"},
		{"Claim, field zero", func(ctx context.Context) error {
			_, err := c.Claim(ctx, malformed(&idemregv1.ClaimRequest{}, fieldZero))
			return err
		}, authenticated, "Claim", codes.InvalidArgument, idemregv1.ReasonMalformedRequest, "idemreg.v1.ClaimRequest", "billing"},
		{"InspectRecord", func(ctx context.Context) error {
			_, err := admin.InspectRecord(ctx, malformed(&idemregv1.InspectRecordRequest{}, truncatedField))
			return err
		}, authenticated, "InspectRecord", codes.InvalidArgument, idemregv1.ReasonMalformedRequest, "idemreg.v1.InspectRecordRequest", "billing"},
		{"health, public", func(ctx context.Context) error {
			_, err := healthpb.NewHealthClient(conn).Check(ctx, malformed(&healthpb.HealthCheckRequest{}, truncatedField))
			return err
		}, t.Context(), "Check", codes.InvalidArgument, idemregv1.ReasonMalformedRequest, "grpc.health.v1.HealthCheckRequest", ""},
		{"unknown caller: authentication first", func(ctx context.Context) error {
			_, err := c.Lookup(ctx, malformed(&idemregv1.LookupRequest{}, truncatedField))
			return err
		}, t.Context(), "Lookup", codes.Unauthenticated, idemregv1.ReasonUnauthenticated, "", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(logs.lines(t, "finished call"))
			err := tc.call(tc.ctx)
			st := requireStatus(t, err, tc.code, tc.reason)
			if tc.message != "" {
				require.ErrorIs(t, client.FromError(err), client.ErrInvalidArgument, "the Go client's typed error")
				require.Equal(t, tc.message, detail[*errdetails.ErrorInfo](t, err).GetMetadata()["message"])
				require.Contains(t, st.Message(), "the request is not a valid encoding of "+tc.message)
			}
			calls := logs.waitLines(t, "finished call", before+1)
			require.Len(t, calls, before+1, "one access log line")
			line := calls[len(calls)-1]
			require.Equal(t, tc.method, line["grpc.method"])
			require.Equal(t, rpccode.Code(tc.code).String(), line["grpc.code"])
			require.Equal(t, "INFO", line["level"], "the caller's own mistake")
			if tc.identity != "" {
				require.Equal(t, tc.identity, line["identity"], "refused after authentication")
			}
		})
	}

	// A stream's message that does not decode ends the stream the same way.
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	require.NoError(t, stream.Send(malformed(&reflectionpb.ServerReflectionRequest{}, truncatedField)))
	_, err = stream.Recv()
	requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)

	// otelgrpc leaves health checks out (server.go); the other five
	// malformed calls are counted. The server records a call after its
	// status is sent, so the count may lag the client's answers.
	byCode := func() map[string]uint64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(t.Context(), &rm))
		out := map[string]uint64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if h, ok := m.Data.(metricdata.Histogram[float64]); ok && m.Name == "rpc.server.call.duration" {
					for _, dp := range h.DataPoints {
						code, _ := dp.Attributes.Value("rpc.response.status_code")
						out[code.AsString()] += dp.Count
					}
				}
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return byCode()["INVALID_ARGUMENT"] == 5 }, 5*time.Second, 10*time.Millisecond,
		"counted as refused calls")
	got := byCode()
	require.Zero(t, got["INTERNAL"], "none is counted as a bug; by code: %v", got)
	require.EqualValues(t, 1, got["UNAUTHENTICATED"], "by code: %v", got)

	_, err = c.Claim(authenticated, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "after"})
	require.NoError(t, err, "still serving")
}

// TestMalformedOnHealthListener: the plaintext health listener decodes
// like the main one, so a malformed check is INVALID_ARGUMENT there too.
func TestMalformedOnHealthListener(t *testing.T) {
	srv, err := server.New(memStore(t), server.Config{})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 2)
	go func() { done <- srv.Serve(ctx, lis) }()
	go func() { done <- srv.ServeHealth(hlis) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, <-done)
	})
	hc := healthpb.NewHealthClient(servertest.Dial(t, hlis.Addr().String()))
	_, err = hc.Check(t.Context(), malformed(&healthpb.HealthCheckRequest{}, truncatedField))
	requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	_, err = hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: server.LivenessService})
	require.NoError(t, err, "still serving")
}
