package httpserve_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

// downStore is a store whose Ping fails while down is set, as a
// database that stopped answering.
type downStore struct {
	storage.Store
	down atomic.Bool
}

func (s *downStore) Ping(ctx context.Context) error {
	if s.down.Load() {
		return errors.New("the database is down")
	}
	return s.Store.Ping(ctx)
}

// TestHealthChecks: /readyz and /healthz of a real server, on an HTTP
// listener served as serve serves its metrics, answer what its gRPC
// health service answers, asked over the network at the same moments:
// NOT_SERVING before Serve and while the store is down (503), SERVING
// (200) when it answers; liveness SERVING throughout; a service the
// health service does not know 404; every service NOT_SERVING once the
// server stops.
func TestHealthChecks(t *testing.T) {
	mem, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = mem.Close() })
	store := &downStore{Store: mem}
	srv, err := server.New(store, server.Config{HealthInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	conn, err := srv.InProcess()
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	mux := http.NewServeMux()
	httpserve.HealthChecks{Client: healthpb.NewHealthClient(conn), Liveness: server.LivenessService}.Register(mux)
	stop, addr, err := httpserve.Serve("metrics", "127.0.0.1:0", mux, httpserve.DefaultBounds(), slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(stop)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	health := healthpb.NewHealthClient(dialGRPC(t, lis.Addr().String()))
	// grpcSays is what a gRPC health check of service answers, as HTTP
	// answers it.
	grpcSays := func(service string) int {
		res, err := health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: service})
		require.NoError(t, err)
		if res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return http.StatusOK
		}
		return http.StatusServiceUnavailable
	}
	httpSays := func(path string) (int, string) {
		res, err := http.Get("http://" + addr.String() + path)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, strings.TrimSpace(string(b))
	}

	// Before Serve: not ready (nothing checked the store yet), alive.
	code, body := httpSays("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "NOT_SERVING", body)
	code, body = httpSays("/healthz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "SERVING", body)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			cancel()
			<-done
		}
	})

	// agree waits until gRPC health answers want for service, then
	// requires HTTP's path to answer the same.
	agree := func(service, path string, want int) {
		t.Helper()
		require.Eventually(t, func() bool { return grpcSays(service) == want }, 10*time.Second, 10*time.Millisecond)
		code, body := httpSays(path)
		require.Equal(t, want, code, "%s: %s", path, body)
	}
	agree("", "/readyz", http.StatusOK)
	agree("idemreg.v1.RegistryService", "/readyz?service=idemreg.v1.RegistryService", http.StatusOK)
	store.down.Store(true)
	agree("", "/readyz", http.StatusServiceUnavailable)
	agree("idemreg.v1.AdminService", "/readyz?service=idemreg.v1.AdminService", http.StatusServiceUnavailable)
	agree(server.LivenessService, "/healthz", http.StatusOK)
	store.down.Store(false)
	agree("", "/readyz", http.StatusOK)

	code, body = httpSays("/readyz?service=no.such.Service")
	require.Equal(t, http.StatusNotFound, code, body)
	res, err := http.Post("http://"+addr.String()+"/readyz", "text/plain", nil)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, res.StatusCode)

	// Stopped: every service NOT_SERVING, so that a load balancer drains
	// the replica (asked over the in-process connection, which outlives
	// the listener).
	cancel()
	stopped = true
	require.NoError(t, <-done)
	code, body = httpSays("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, body)
}

func dialGRPC(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
