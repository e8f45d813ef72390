package sharedport

import (
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
)

// BenchmarkGRPCTransport measures what the two ways of answering HTTP on
// the gRPC port cost a gRPC call, with a health Check as the
// call, over loopback, from parallel callers on one connection:
//
//   - native: grpc.Server.Serve on the listener, as without the HTTP API;
//
//   - split: the same, behind Split (what serve does): the connection
//     is told apart when it opens, then runs on grpc-go's transport;
//
//   - servehttp: every connection through net/http's HTTP/2 server (h2c)
//     and grpc.Server.ServeHTTP, which is what a handler in front of all
//     calls (vanguard or connect-go serving gRPC too) would make of it.
//
//     go test -run '^$' -bench GRPCTransport -benchmem -count 3 ./cmd/idemreg/internal/sharedport/
func BenchmarkGRPCTransport(b *testing.B) {
	serve := map[string]func(b *testing.B, g *grpc.Server, lis net.Listener){
		"native": func(b *testing.B, g *grpc.Server, lis net.Listener) { go func() { _ = g.Serve(lis) }() },
		"split": func(b *testing.B, g *grpc.Server, lis net.Listener) {
			grpcLis, httpLis := Split(lis, nil, time.Second, slog.New(slog.DiscardHandler))
			stop, err := ServeAPI(g, nil, 4<<20, httpLis, nil, nil, httpserve.DefaultBounds(), slog.New(slog.DiscardHandler))
			require.NoError(b, err)
			b.Cleanup(stop)
			go func() { _ = g.Serve(grpcLis) }()
		},
		"servehttp": func(b *testing.B, g *grpc.Server, lis net.Listener) {
			srv := &http.Server{Handler: g, Protocols: new(http.Protocols)}
			srv.Protocols.SetUnencryptedHTTP2(true)
			go func() { _ = srv.Serve(lis) }()
			b.Cleanup(func() { _ = srv.Close() })
		},
	}
	for _, name := range []string{"native", "split", "servehttp"} {
		b.Run(name, func(b *testing.B) {
			g := grpc.NewServer()
			healthpb.RegisterHealthServer(g, health.NewServer())
			b.Cleanup(g.Stop)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(b, err)
			serve[name](b, g, lis)
			conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			require.NoError(b, err)
			b.Cleanup(func() { _ = conn.Close() })
			hc := healthpb.NewHealthClient(conn)
			_, err = hc.Check(b.Context(), &healthpb.HealthCheckRequest{})
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := hc.Check(b.Context(), &healthpb.HealthCheckRequest{}); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
