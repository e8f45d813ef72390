//go:build linearizability

package lincheck

import (
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestConsumerWorkloadSIGKILL runs the consumer workload against a real
// `idemreg serve` that it kills with SIGKILL twice and restarts, on the
// embedded store and on PostgreSQL: Completes held for the next Claim, in
// flight, or retried die with it. Every message whose Done resolved without
// error must replay its outcome afterwards, with its token, and no key may
// hold a result none of its handlers returned. About 4 s per store.
//
//	cd tests && go test -tags linearizability -run TestConsumerWorkloadSIGKILL -v ./lincheck
func TestConsumerWorkloadSIGKILL(t *testing.T) {
	bin := buildServe(t)
	for name, setup := range map[string]func(t *testing.T) (args, env []string){
		"embedded": func(t *testing.T) ([]string, []string) { return []string{"--data-dir", t.TempDir()}, nil },
		"postgres": func(t *testing.T) ([]string, []string) {
			return nil, []string{"IDEMREG_DATABASE_URL=" + pgtest.NewDatabase(t)}
		},
	} {
		t.Run(name, func(t *testing.T) {
			args, env := setup(t)
			s := &serve{t: t, bin: bin, addr: freeLoopbackAddr(t), args: args, env: env}
			s.start()
			conn, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithConnectParams(grpc.ConnectParams{
					Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond},
					MinConnectTimeout: time.Second,
				}))
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close() })
			s.conn = conn
			s.waitServing()

			w := NewConsumerWorkload(conn, ConsumerConfig{Seed: uint64(time.Now().UnixNano())})
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan struct{})
			go func() { defer close(done); w.Run(ctx) }()
			for range 2 {
				time.Sleep(time.Second)
				s.kill()
				s.start()
				s.waitServing()
			}
			time.Sleep(time.Second)
			cancel()
			<-done
			t.Log(w.Stats())
			require.Empty(t, w.Unexpected())
			require.Empty(t, w.Verify(t.Context()))
			require.Positive(t, w.Acknowledged())
		})
	}
}

// serve is one `idemreg serve` at a fixed address, killed and restarted.
type serve struct {
	t         *testing.T
	bin, addr string
	args, env []string
	cmd       *exec.Cmd
	conn      *grpc.ClientConn
}

func (s *serve) start() {
	cmd := exec.Command(s.bin, append([]string{"serve", "--listen", s.addr, "--log-level", "error"}, s.args...)...)
	cmd.Env = append(os.Environ(), s.env...)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	require.NoError(s.t, cmd.Start())
	s.cmd = cmd
	s.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
}

func (s *serve) kill() {
	require.NoError(s.t, s.cmd.Process.Signal(syscall.SIGKILL))
	_ = s.cmd.Wait()
}

func (s *serve) waitServing() {
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		res, err := healthpb.NewHealthClient(s.conn).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Fatal("idemreg serve is not serving after 60s")
}

// buildServe builds cmd/idemreg of this checkout (the tests module's
// replace names it).
func buildServe(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemreg/idemreg").Output()
	require.NoError(t, err)
	bin := filepath.Join(t.TempDir(), "idemreg")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/idemreg")
	cmd.Dir = strings.TrimSpace(string(out))
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", b)
	return bin
}

func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer lis.Close()
	return lis.Addr().String()
}
