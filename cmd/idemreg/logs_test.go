package main

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestServeLogs: the binary's log lines write durations as Go does, and a
// call's lines carry the trace of the call (here the caller's, sent as a
// W3C traceparent: without an exporter, serve starts no spans of its own).
func TestServeLogs(t *testing.T) {
	bin := servetest.Binary(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--drain-delay", "1500ms")
	sweeper := p.WaitLog(t, "sweeper on")
	require.Equal(t, "1m0s", sweeper["sweep_interval"], "a duration, not 60000000000")
	p.WaitLog(t, "serving")

	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
	require.NoError(t, err)
	call := p.WaitLog(t, "finished call")
	require.Equal(t, traceID, call["trace_id"])
	require.NotEmpty(t, call["span_id"])

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	drain := p.WaitLog(t, "not serving, waiting for load balancers")
	require.Equal(t, "1.5s", drain["drain_delay"])
	require.NotContains(t, drain, "trace_id", "a line outside any call has no trace")
	require.NoError(t, p.Cmd.Wait())
}
