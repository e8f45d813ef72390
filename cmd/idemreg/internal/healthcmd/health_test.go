package healthcmd

import (
	"bytes"
	"flag"
	"io"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
)

// check runs health with args and returns what it printed and its error.
func check(t *testing.T, args ...string) (string, error) {
	t.Helper()
	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	exec := Command(fs)
	require.NoError(t, cmdline.Parse(fs, args))
	var stdout bytes.Buffer
	err := exec(t.Context(), &stdout, io.Discard)
	return stdout.String(), err
}

// TestHealth asks a real gRPC health server: exit 0 and SERVING for a
// serving service, ExitNotServing and the status for one that is not, and
// ExitNotServing for a service it does not know and for an address where
// nothing answers.
func TestHealth(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("liveness", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("draining", healthpb.HealthCheckResponse_NOT_SERVING)
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	addr := lis.Addr().String()

	for _, service := range []string{"", "liveness"} {
		out, err := check(t, "--addr", addr, "--service", service)
		require.NoError(t, err, "service %q", service)
		require.Equal(t, "SERVING\n", out)
	}

	out, err := check(t, "--addr", addr, "--service", "draining")
	require.Equal(t, "NOT_SERVING\n", out)
	code, ok := command.Status(err)
	require.True(t, ok)
	require.Equal(t, ExitNotServing, code)
	require.EqualError(t, err, "not serving")

	_, err = check(t, "--addr", addr, "--service", "unknown")
	code, _ = command.Status(err)
	require.Equal(t, ExitNotServing, code)
	require.ErrorContains(t, err, "health check of "+addr)

	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	nowhere := closed.Addr().String()
	require.NoError(t, closed.Close())
	_, err = check(t, "--addr", nowhere, "--timeout", "500ms")
	code, _ = command.Status(err)
	require.Equal(t, ExitNotServing, code)
	require.ErrorContains(t, err, "health check of "+nowhere)
}
