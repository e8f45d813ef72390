package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sharedport"
	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/server"
)

// TestHTTPAPINeverSpeaksHTTP2OverTLS: in deploy/'s shape (TLS with a
// client CA), a client that offers h2 and http/1.1 (curl, browsers) is
// the HTTP API's, and negotiates http/1.1 there: net/http's HTTP/2 server
// would hold 250 streams per connection with none of the gRPC side's
// bounds (--max-pending-calls, --max-concurrent-streams). A client that
// sends HTTP/2 anyway gets no HTTP/2 answer.
func TestHTTPAPINeverSpeaksHTTP2OverTLS(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing"})
	configPath := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(configPath, []byte(`
identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
`), 0o600))
	p := servetest.Start(t, bin, dir, nil, "--data-dir", t.TempDir(), "--config", configPath,
		"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem"),
		"--tls-client-ca", filepath.Join(dir, "ca.pem"))
	p.WaitLog(t, "serving")
	cfg := clientTLS(t, dir, "billing")

	t.Run("curl's offer negotiates http/1.1", func(t *testing.T) {
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg.Clone(), ForceAttemptHTTP2: true}}
		code, ok, _ := postJSON(t, hc, "https://"+p.Addr, "Claim", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"m-1"}`)
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "OUTCOME_ACQUIRED", ok["outcome"])

		c := cfg.Clone()
		c.NextProtos = []string{"h2", "http/1.1"}
		conn, err := tls.Dial("tcp", p.Addr, c)
		require.NoError(t, err)
		defer conn.Close()
		require.Equal(t, "http/1.1", conn.ConnectionState().NegotiatedProtocol)
	})

	t.Run("HTTP/2 sent anyway is not served", func(t *testing.T) {
		c := cfg.Clone()
		c.NextProtos = []string{"h2", "http/1.1"}
		conn, err := tls.Dial("tcp", p.Addr, c)
		require.NoError(t, err)
		defer conn.Close()
		// The preface, SETTINGS and a call's HEADERS without its message:
		// a held call, had HTTP/2 been spoken.
		_, err = io.WriteString(conn, http2Preface)
		require.NoError(t, err)
		// The server may close as soon as it reads the preface: what
		// follows may not be written.
		fr := http2.NewFramer(conn, conn)
		_ = fr.WriteSettings()
		var hb strings.Builder
		enc := hpack.NewEncoder(&hb)
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":authority", p.Addr},
			{":path", "/idemreg.v1.RegistryService/Claim"}, {"content-type", "application/json"}} {
			require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
		}
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte(hb.String()), EndHeaders: true})
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(20*time.Second))) // a guard against a hang
		// An HTTP/2 server answers with its SETTINGS and holds the call;
		// the HTTP/1.1 server answers the preface's "PRI * HTTP/2.0" line
		// as HTTP/1.1, or not at all, and closes.
		answer, err := io.ReadAll(conn)
		require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the connection was held; it answered %q", answer)
		if len(answer) > 0 {
			require.True(t, strings.HasPrefix(string(answer), "HTTP/1.1 "), "%q", answer)
		}
	})
}

const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// clientTLS is a TLS client configuration trusting the test CA, with the
// certificate of client (none when empty).
func clientTLS(t *testing.T, dir, client string) *tls.Config {
	t.Helper()
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(caPEM))
	cfg := &tls.Config{RootCAs: pool}
	if client != "" {
		cert, err := tls.LoadX509KeyPair(filepath.Join(dir, client+".pem"), filepath.Join(dir, client+"-key.pem"))
		require.NoError(t, err)
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg
}

// dialerFrom dials from source address ip (all of 127.0.0.0/8 is
// loopback), so that per-source caps can be tested on one machine.
func dialerFrom(ip string) *net.Dialer {
	return &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
}

// grpcFrom is a gRPC client connection to addr from source address ip.
func grpcFrom(t *testing.T, ip, addr string) *grpc.ClientConn {
	t.Helper()
	d := dialerFrom(ip)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// held counts the connections of conns the server still holds open: a
// read on one it closed ends at once; on one it holds, at the deadline.
func held(t *testing.T, conns []net.Conn) int {
	t.Helper()
	var wg sync.WaitGroup
	var n atomic.Int64
	for _, c := range conns {
		wg.Go(func() {
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			_, err := io.Copy(io.Discard, c)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				n.Add(1)
			}
		})
	}
	wg.Wait()
	return int(n.Load())
}

// TestConnectingShareOfOneSource: a source that opens connections to
// --listen and sends nothing (a slowloris) holds at most
// --max-connecting-per-source of the connections being told apart; its
// others are closed at once, and another source's client is served while
// the silent ones wait for --connection-timeout. On main the one bound
// of 256 was the source's alone: a new client waited for the timeout.
func TestConnectingShareOfOneSource(t *testing.T) {
	bin := servetest.Binary(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--data-dir", t.TempDir(), "--connection-timeout", "60s")
	p.WaitLog(t, "serving")

	const silent = sharedport.MaxSniffing + 44
	var conns []net.Conn
	for range silent {
		c, err := dialerFrom("127.0.0.2").Dial("tcp", p.Addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		conns = append(conns, c)
	}
	// Dialled after the silent ones, so accepted after them: on main it
	// waited for one of them to time out (60 s).
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	_, err := healthpb.NewHealthClient(grpcFrom(t, "127.0.0.3", p.Addr)).Check(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err, "another source's client is served while the silent ones are held")
	require.LessOrEqual(t, held(t, conns), sharedport.DefaultMaxSniffingPerSource, "the silent source holds at most its share")
}

// keepAliveCall sends a health check over the HTTP API on c (HTTP/1.1,
// kept alive) and reads its answer.
func keepAliveCall(c net.Conn, br *bufio.Reader) error {
	if _, err := io.WriteString(c, "POST /grpc.health.v1.Health/Check HTTP/1.1\r\nHost: idemreg\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"); err != nil {
		return err
	}
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if _, err := io.Copy(io.Discard, res.Body); err != nil {
		return err
	}
	if res.StatusCode != http.StatusOK {
		return errors.New(res.Status)
	}
	return nil
}

// TestHTTPAPIConnectionsPerSource: 100 idle kept-alive connections from
// one source (on main they took all 64 of the HTTP API's connections, and
// every other caller's was closed at once) hold at most
// --http-max-connections-per-source; another source is served. A
// connection kept busy is closed at --http-max-connection-age, where on
// main each request renewed its idle timeout for ever.
func TestHTTPAPIConnectionsPerSource(t *testing.T) {
	bin := servetest.Binary(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--data-dir", t.TempDir(), "--http-max-connection-age", "2s")
	p.WaitLog(t, "serving")
	perSource := httpserve.DefaultBounds().MaxConnectionsPerSource

	t.Run("idle keep-alive flood", func(t *testing.T) {
		var conns []net.Conn
		for range 100 {
			c, err := dialerFrom("127.0.0.2").Dial("tcp", p.Addr)
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			_ = keepAliveCall(c, bufio.NewReader(c)) // one beyond the cap may be refused
			conns = append(conns, c)
		}
		c, err := dialerFrom("127.0.0.3").Dial("tcp", p.Addr)
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, keepAliveCall(c, bufio.NewReader(c)), "another source is served")
		require.LessOrEqual(t, held(t, conns), perSource, "the flooding source holds at most its share")
	})

	t.Run("a busy connection ages out", func(t *testing.T) {
		c, err := dialerFrom("127.0.0.4").Dial("tcp", p.Addr)
		require.NoError(t, err)
		defer c.Close()
		br := bufio.NewReader(c)
		require.NoError(t, keepAliveCall(c, br))
		// A request every 100 ms renews the idle timeout (60 s); the age
		// (2 s) closes the connection between two requests.
		require.Eventually(t, func() bool { return keepAliveCall(c, br) != nil }, 30*time.Second, 100*time.Millisecond,
			"the connection was kept past its age")
	})
}

// TestHealthProbeUnderFlood: a source that opens more connections to the
// health listener than --max-connections (each through its HTTP/2
// handshake, so held) holds at most --max-health-connections-per-source;
// a probe from another source (the kubelet's, from the node) is served.
// On main the flood took every slot and the probe waited in the accept
// queue.
func TestHealthProbeUnderFlood(t *testing.T) {
	bin := servetest.Binary(t)
	healthAddr := servetest.FreeAddr(t)
	const maxConns = 32
	p := servetest.Start(t, bin, t.TempDir(), nil, "--data-dir", t.TempDir(), "--health-listen", healthAddr,
		"--max-connections", strconv.Itoa(maxConns))
	p.WaitLog(t, "serving")

	var conns []net.Conn
	for range maxConns + 8 {
		c, err := dialerFrom("127.0.0.2").Dial("tcp", healthAddr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		// The client preface and an empty SETTINGS frame: a connection
		// the server holds past --connection-timeout.
		_, _ = io.WriteString(c, http2Preface+"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
		conns = append(conns, c)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	start := time.Now()
	_, err := healthpb.NewHealthClient(grpcFrom(t, "127.0.0.3", healthAddr)).Check(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err, "the probe from another source is served")
	t.Logf("probe took %v", time.Since(start))
	require.LessOrEqual(t, held(t, conns), server.DefaultMaxHealthConnectionsPerSource, "the flooding source holds at most its share")
}
