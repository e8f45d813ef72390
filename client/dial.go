package client

import "google.golang.org/grpc"

// StaticWindow is the HTTP/2 flow-control window, in bytes, that
// DialOptions fixes on a connection: the one idemreg serve fixes on its
// side by default (--static-window).
const StaticWindow = 1 << 20

// DialOptions are the options a connection to the registry should carry
// besides its credentials:
//
//	conn, err := grpc.NewClient(addr, append(client.DialOptions(), grpc.WithTransportCredentials(creds))...)
//
// They fix the HTTP/2 flow-control windows at StaticWindow. With grpc-go's
// dynamic windows each side sends a BDP ping with nearly every small
// message it receives, and the registry's messages are small: the server
// fixing its own windows does not stop the client's pings. Measured side
// by side (docs/benchmarks.md, issue 36), fixed windows on both sides took
// 20–41% of the CPU per call off at 1 caller and 11–32% at 8.
func DialOptions() []grpc.DialOption {
	// WithInitialWindowSize and WithInitialConnWindowSize, not the newer
	// WithStatic*WindowSize: they exist at the client's gRPC floor
	// (.ci/client-minversions), and there as in later releases a window
	// set so turns dynamic windows off.
	return []grpc.DialOption{grpc.WithInitialWindowSize(StaticWindow), grpc.WithInitialConnWindowSize(StaticWindow)}
}
