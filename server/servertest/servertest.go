// Package servertest runs a real registry server for tests: on a loopback
// listener, stopped and checked when the test ends. It is the one harness
// the server's, the client's and the harnesses' tests share.
package servertest

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
)

// Serve starts a server on store with cfg on a loopback port until the test
// ends, when it is stopped and must have stopped cleanly. It returns the
// address and the server.
func Serve(t testing.TB, store storage.Store, cfg server.Config) (string, *server.Server) {
	t.Helper()
	srv, err := server.New(store, cfg)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return lis.Addr().String(), srv
}

// Dial connects to addr, in plaintext unless opts say otherwise, and closes
// the connection when the test ends.
func Dial(t testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Start serves store with cfg and returns a plaintext connection to it.
func Start(t testing.TB, store storage.Store, cfg server.Config) *grpc.ClientConn {
	t.Helper()
	addr, _ := Serve(t, store, cfg)
	return Dial(t, addr)
}
