package main

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestHTTPAPINeverSpeaksHTTP2OverTLS: in deploy/'s shape (TLS with a
// client CA), a client that offers h2 and http/1.1 (curl, browsers) is
// the HTTP API's, and negotiates http/1.1 there: net/http's HTTP/2 server
// would hold 250 streams per connection with none of the gRPC side's
// bounds (--max-pending-calls, --max-concurrent-streams). A client that
// sends HTTP/2 anyway gets no HTTP/2 answer.
func TestHTTPAPINeverSpeaksHTTP2OverTLS(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing"})
	configPath := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(configPath, []byte(`
identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
`), 0o600))
	p := startServe(t, bin, dir, nil, "--data-dir", t.TempDir(), "--config", configPath,
		"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem"),
		"--tls-client-ca", filepath.Join(dir, "ca.pem"))
	p.waitLog(t, "serving")
	cfg := clientTLS(t, dir, "billing")

	t.Run("curl's offer negotiates http/1.1", func(t *testing.T) {
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg.Clone(), ForceAttemptHTTP2: true}}
		code, ok, _ := postJSON(t, hc, "https://"+p.addr, "Claim", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"m-1"}`)
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "OUTCOME_ACQUIRED", ok["outcome"])

		c := cfg.Clone()
		c.NextProtos = []string{"h2", "http/1.1"}
		conn, err := tls.Dial("tcp", p.addr, c)
		require.NoError(t, err)
		defer conn.Close()
		require.Equal(t, "http/1.1", conn.ConnectionState().NegotiatedProtocol)
	})

	t.Run("HTTP/2 sent anyway is not served", func(t *testing.T) {
		c := cfg.Clone()
		c.NextProtos = []string{"h2", "http/1.1"}
		conn, err := tls.Dial("tcp", p.addr, c)
		require.NoError(t, err)
		defer conn.Close()
		// The preface, SETTINGS and a call's HEADERS without its message:
		// a held call, had HTTP/2 been spoken.
		_, err = io.WriteString(conn, http2Preface)
		require.NoError(t, err)
		fr := http2.NewFramer(conn, conn)
		require.NoError(t, fr.WriteSettings())
		var hb strings.Builder
		enc := hpack.NewEncoder(&hb)
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":authority", p.addr},
			{":path", "/idemreg.v1.RegistryService/Claim"}, {"content-type", "application/json"}} {
			require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
		}
		require.NoError(t, fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte(hb.String()), EndHeaders: true}))
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
