package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// TestServeRefusesToOpenUp: serve refuses settings that would expose the
// registry wider than asked for, before it opens anything.
func TestServeRefusesToOpenUp(t *testing.T) {
	dir := t.TempDir()
	noIdentities := filepath.Join(dir, "open.yaml")
	require.NoError(t, os.WriteFile(noIdentities, []byte("consumers: []\n"), 0o600))
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"plaintext off loopback", []string{"--listen", "0.0.0.0:0"}, "not a loopback address: serve TLS (--tls-cert, --tls-key) or pass --plaintext"},
		{"no identities off loopback", []string{"--listen", "0.0.0.0:0", "--plaintext", "--config", noIdentities}, "names no identities"},
		{"no config off loopback", []string{"--listen", "0.0.0.0:0", "--plaintext"}, "--allow-unauthenticated"},
		{"cert without key", []string{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key go together"},
		{"client CA without cert", []string{"--tls-client-ca", "ca.pem"}, "--tls-client-ca needs --tls-cert"},
		{"plaintext and TLS", []string{"--plaintext", "--tls-cert", "c.pem", "--tls-key", "k.pem"}, "--plaintext contradicts --tls-cert"},
		{"missing TLS files", []string{"--tls-cert", "missing.pem", "--tls-key", "missing-key.pem", "--data-dir", filepath.Join(dir, "data")}, "missing.pem"},
		{"timeouts", []string{"--request-timeout", "10s", "--max-request-timeout", "5s"}, "--max-request-timeout"},
		{"in flight", []string{"--max-in-flight", "0"}, "--max-in-flight must be positive"},
		{"stream workers", []string{"--stream-workers", "-1"}, "--stream-workers must not be negative"},
		{"static window too small", []string{"--static-window", "1024"}, "--static-window must be between 65536 and 2147483647 bytes"},
		{"static window not a number", []string{"--static-window", "1MiB"}, "invalid value"},
		{"static window negative", []string{"--static-window", "-1"}, "--static-window must not be negative (0 turns it off)"},
		{"no header bound", []string{"--max-header-list-size", "0"}, "--max-header-list-size (0)"},
		{"header bound too small", []string{"--max-header-list-size", "100"}, "header list bound must be between"},
		{"header bound not a number", []string{"--max-header-list-size", "16KiB"}, "invalid value"},
		{"no stream bound", []string{"--max-concurrent-streams", "0"}, "--max-concurrent-streams (0)"},
		{"no connection bound", []string{"--max-connections", "0"}, "--max-connections (0)"},
		{"no public stream bound", []string{"--max-public-streams", "-1"}, "--max-public-streams (-1)"},
		{"no per-identity bound", []string{"--max-calls-per-identity", "0"}, "--max-calls-per-identity (0)"},
		{"no pending call bound", []string{"--max-pending-calls", "0"}, "--max-pending-calls (0)"},
		{"no HTTP connection bound", []string{"--http-max-connections", "0"}, "--http-max-connections (0)"},
		{"no HTTP read timeout", []string{"--http-read-timeout", "0s"}, "--http-read-timeout (0s)"},
		{"no handshake timeout", []string{"--connection-timeout", "0s"}, "--connection-timeout (0s)"},
		{"no idle timeout", []string{"--max-connection-idle", "0s"}, "--max-connection-idle must be positive"},
		{"no readiness window", []string{"--readiness-window", "0"}, "--readiness-window (0)"},
		{"readiness ratio above one", []string{"--readiness-max-failure-ratio", "2"}, "failure ratio must be in (0, 1]"},
		{"no waiters", []string{"--max-waiters", "0"}, "--max-waiters must be positive"},
		{"re-check too slow", []string{"--wait-recheck", "1m"}, "--wait-recheck must be between"},
		{"members dead before their next heartbeat", []string{"--heartbeat-interval", "2s", "--member-live-for", "1s"}, "--member-live-for must be more than the heartbeat interval"},
		{"advertise address without a port", []string{"--advertise-address", "10.0.0.1"}, "--advertise-address must be host:port"},
		{"quota refresh too often", []string{"--quota-refresh", "10ms"}, "--quota-refresh must be at least 1s"},
		{"parked count too often", []string{"--parked-count-interval", "10ms"}, "--parked-count-interval must be at least 1s"},
		{"identity share above the server's", []string{"--max-in-flight", "8", "--max-in-flight-per-identity", "9"}, "--max-in-flight-per-identity must be between 0"},
		{"wait share above the server's", []string{"--max-waiters", "8", "--max-waiters-per-identity", "9"}, "--max-waiters-per-identity must be between 0"},
		{"wait share negative", []string{"--max-waiters-per-identity", "-1"}, "--max-waiters-per-identity"},
		{"no quota consumers", []string{"--max-quota-consumers-per-identity", "0"}, "--max-quota-consumers-per-identity must be positive"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := run(t.Context(), append([]string{"serve", "--data-dir", filepath.Join(dir, "data")}, tc.args...), io.Discard, io.Discard)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:7350": true, "[::1]:7350": true, "localhost:7350": true, "127.0.0.2:1": true,
		"0.0.0.0:7350": false, ":7350": false, "[::]:7350": false, "10.0.0.1:7350": false, "idemreg:7350": false, "bad": false,
	} {
		require.Equal(t, want, access.Loopback(addr), addr)
	}
}

// testCA writes a CA, a server certificate for 127.0.0.1 and client
// certificates with the given URI SANs into dir.
func testCA(t *testing.T, dir string, clients map[string]string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	write := func(name, kind string, der []byte) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600))
	}
	write("ca.pem", "CERTIFICATE", caDER)
	issue := func(name string, serial int64, tmpl *x509.Certificate) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl.SerialNumber, tmpl.NotBefore, tmpl.NotAfter = big.NewInt(serial), time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		require.NoError(t, err)
		write(name+".pem", "CERTIFICATE", der)
		write(name+"-key.pem", "PRIVATE KEY", keyDER)
	}
	issue("server", 2, &x509.Certificate{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	serial := int64(3)
	for name, uri := range clients {
		u, err := url.Parse(uri)
		require.NoError(t, err)
		issue(name, serial, &x509.Certificate{URIs: []*url.URL{u}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
		serial++
	}
}

func mtlsConn(t *testing.T, dir, client, addr string) *grpc.ClientConn {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, client+".pem"), filepath.Join(dir, client+"-key.pem"))
	require.NoError(t, err)
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(caPEM))
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// TestServeProduction runs the binary as deploy/ does: mTLS, identities
// from --config, the metrics and health listeners; then reloads the
// identities on SIGHUP and stops on SIGTERM.
func TestServeProduction(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing", "orders": "spiffe://test/orders"})
	configPath := filepath.Join(dir, "idemreg.yaml")
	writeConfig := func(ordersConsumers string) {
		require.NoError(t, os.WriteFile(configPath, []byte(`
consumers:
  - prefix: billing.
    lease: {default: 1m}
identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
  - {name: orders, uris: ["spiffe://test/orders"], consumers: [`+ordersConsumers+`]}
`), 0o600))
	}
	writeConfig(`"orders.inbox"`)
	metricsAddr, healthAddr := servetest.FreeAddr(t), servetest.FreeAddr(t)
	p := servetest.Start(t, bin, dir, nil, "--data-dir", filepath.Join(dir, "data"), "--config", configPath,
		"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem"),
		"--tls-client-ca", filepath.Join(dir, "ca.pem"),
		"--metrics-listen", metricsAddr, "--health-listen", healthAddr, "--drain-delay", "200ms",
		"--max-public-streams", "1")
	p.WaitLog(t, "serving")

	claim := func(client, consumer string) error {
		_, err := idemregv1.NewRegistryServiceClient(mtlsConn(t, dir, client, p.Addr)).Claim(t.Context(),
			&idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
		return err
	}
	require.NoError(t, claim("billing", "billing.worker"))
	require.NoError(t, claim("orders", "orders.inbox"))
	require.Equal(t, codes.PermissionDenied, status.Code(claim("orders", "billing.worker")))
	require.Equal(t, codes.PermissionDenied, status.Code(claim("billing", "orders.inbox")))

	out, err := exec.Command(bin, "health", "--addr", healthAddr).CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "SERVING")

	// --max-public-streams reaches the health listener: one Watch is
	// served, the next refused while it lasts.
	hconn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = hconn.Close() })
	watch := func(ctx context.Context) error {
		w, err := healthpb.NewHealthClient(hconn).Watch(ctx, &healthpb.HealthCheckRequest{Service: "liveness"})
		if err == nil {
			_, err = w.Recv()
		}
		return err
	}
	wctx, stopWatch := context.WithCancel(t.Context())
	require.NoError(t, watch(wctx))
	require.Equal(t, codes.ResourceExhausted, status.Code(watch(t.Context())))
	stopWatch()

	res, err := http.Get("http://" + metricsAddr + "/metrics")
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	_ = res.Body.Close()
	metrics := string(body)
	for _, want := range []string{`idemreg_claims_total{`, `outcome="acquired"`, `idemreg_store_duration_seconds_bucket{`,
		`rpc_server_call_duration_seconds_bucket{`, `idemreg_auth_denied_total{`, "go_goroutines", "process_cpu_seconds_total"} {
		require.Contains(t, metrics, want)
	}

	// Grant orders the billing consumer too, and reload.
	writeConfig(`"orders.inbox", "billing.worker"`)
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	p.WaitLog(t, "config reloaded")
	require.NoError(t, claim("orders", "billing.worker"))

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	p.WaitLog(t, "not serving, waiting for load balancers")
	p.WaitLog(t, "stopped")
	require.NoError(t, p.Cmd.Wait())

	out, err = exec.Command(bin, "health", "--addr", healthAddr, "--timeout", "500ms").CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, 1, exit.ExitCode())
}

func TestNewToken(t *testing.T) {
	var out strings.Builder
	require.NoError(t, run(context.Background(), []string{"new-token"}, &out, io.Discard))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2)
	require.True(t, strings.HasPrefix(lines[0], "token: idemreg_"))
	require.Regexp(t, `^hash:  sha256:[0-9a-f]{64}$`, lines[1])
}
