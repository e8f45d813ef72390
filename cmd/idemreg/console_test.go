package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// TestConsoleListenLoopbackOnly: serve refuses a console on an address
// that is not loopback, before it listens on anything, unless
// --console-allow-remote says otherwise (each address's verdict is
// config's TestListenersLoopbackOnly).
func TestConsoleListenLoopbackOnly(t *testing.T) {
	err := runBriefly(t, "serve", "--console-listen", "10.0.0.1:7351")
	require.ErrorContains(t, err, "--console-listen 10.0.0.1:7351 is not a loopback address")
	require.ErrorContains(t, err, "--console-allow-remote")
}

// TestServeConsoleRefuses: serve does not start a console nobody could
// sign in to.
func TestServeConsoleRefuses(t *testing.T) {
	dir := t.TempDir()
	certOnly := filepath.Join(dir, "certs.yaml")
	require.NoError(t, os.WriteFile(certOnly, []byte("identities:\n  - name: svc\n    dns_names: [svc.example]\n    admin: [\"billing.*\"]\n"), 0o600))
	err := runBriefly(t, "serve", "--console-listen", servetest.FreeAddr(t), "--config", certOnly, "--sweep-interval", "0")
	require.ErrorContains(t, err, "all authenticate by client certificate, which a browser's sign-in cannot present: sign operators in through a trusted proxy (--console-proxy-header")
	err = runBriefly(t, "serve", "--console-listen", servetest.FreeAddr(t), "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*=svc",
		"--console-proxy-secret-file", proxySecretFile(t, dir), "--sweep-interval", "0")
	require.ErrorContains(t, err, "the server has no identities")
	// A proxy without its secret: refused at start, on loopback too.
	err = runBriefly(t, "serve", "--console-listen", servetest.FreeAddr(t), "--config", certOnly, "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*=svc", "--sweep-interval", "0")
	require.ErrorContains(t, err, "--console-proxy-header needs --console-proxy-secret-file")
}

// testProxySecret is the secret of the tests' proxy.
const testProxySecret = "7f3c9a0e5b1d4c8f2a6e0b9d3c7f1a5e8b2d6c0f4a9e3b7d1c5f8a2e6b0d4c9f"

// proxySecretFile writes testProxySecret, as echo would, to a file in
// dir and returns its path.
func proxySecretFile(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "console-proxy-secret")
	require.NoError(t, os.WriteFile(path, []byte(testProxySecret+"\n"), 0o600))
	return path
}

// startServeConsole runs serve with args and a console until the test
// ends, and returns the console's base URL.
func startServeConsole(t *testing.T, dir, listen string, args ...string) (base string, logs *syncWriter) {
	t.Helper()
	consoleAddr := servetest.FreeAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	logs = &syncWriter{}
	go func() {
		done <- run(ctx, append([]string{"serve", "--listen", listen, "--data-dir", filepath.Join(dir, "data"),
			"--sweep-interval", "0", "--console-listen", consoleAddr}, args...), io.Discard, logs)
	}()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	return "http://" + consoleAddr, logs
}

// consoleGet GETs u with the header and returns the status and body.
func consoleGet(t *testing.T, c *http.Client, u string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, u, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := c.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

// TestServeConsoleTLS runs the console in deploy/'s shape: serve with
// --tls-cert, --tls-key and --tls-client-ca (mTLS). A worker claims with its
// client certificate; the operator signs in to the console with a token
// and sees the record, which the console read through the server's
// in-process connection as the operator's identity.
func TestServeConsoleTLS(t *testing.T) {
	const token = "console-oncall-token"
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing"})
	cfgFile := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte(`identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
  - {name: oncall, token_hashes: ["`+access.HashToken(token)+`"], admin: ["billing.*"]}
`), 0o600))
	listen := servetest.FreeAddr(t)
	base, logs := startServeConsole(t, dir, listen, "--config", cfgFile,
		"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem"), "--tls-client-ca", filepath.Join(dir, "ca.pem"))

	claimed := claimEventually(t, idemregv1.NewRegistryServiceClient(mtlsConn(t, dir, "billing", listen)))
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	browser := &http.Client{Jar: jar}
	res, err := browser.PostForm(base+"/signin", url.Values{"token": {token}})
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	code, body := consoleGet(t, browser, base+"/record?"+url.Values{"consumer": {"billing.payment-worker"}, "kind": {"KIND_OPERATION"}, "key": {"charge:order-42"}}.Encode())
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
	require.Contains(t, body, `<dd id="token">`+strconv.FormatInt(claimed.GetToken(), 10)+`</dd>`)
	require.NotContains(t, logs.String(), token, "the token is never logged")
}

// TestServeConsoleCertificateIdentities runs the console where every
// identity authenticates by client certificate: operators sign in through
// a trusted proxy's header (a sidecar on loopback) sent with the proxy's
// secret, mapped to the identity the console then acts as; from loopback
// without the secret the header signs nobody in.
func TestServeConsoleCertificateIdentities(t *testing.T) {
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing"})
	cfgFile := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte(`identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
  - {name: oncall, uris: ["spiffe://test/oncall"], admin: ["billing.*"]}
`), 0o600))
	listen := servetest.FreeAddr(t)
	base, logs := startServeConsole(t, dir, listen, "--config", cfgFile,
		"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem"), "--tls-client-ca", filepath.Join(dir, "ca.pem"),
		"--console-proxy-header", "X-Auth-Request-User", "--console-proxy-user", "*@ops.example.com=oncall",
		"--console-proxy-secret-file", proxySecretFile(t, dir))

	claimed := claimEventually(t, idemregv1.NewRegistryServiceClient(mtlsConn(t, dir, "billing", listen)))
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	browser := &http.Client{Jar: jar}
	u := base + "/record?" + url.Values{"consumer": {"billing.payment-worker"}, "kind": {"KIND_OPERATION"}, "key": {"charge:order-42"}}.Encode()

	// A port-forward (kubectl port-forward, ssh -L) arrives on loopback as
	// the proxy does: the header without the proxy's secret, or with a
	// wrong one, signs nobody in (issue 35, weakness 4).
	for name, secret := range map[string]string{"no secret": "", "wrong secret": strings.Repeat("0", len(testProxySecret))} {
		header := []string{"X-Auth-Request-User", "alice@ops.example.com"}
		if secret != "" {
			header = append(header, console.ProxySecretHeader, secret)
		}
		code, body := consoleGet(t, browser, u, header...)
		require.Equal(t, http.StatusForbidden, code, "%s: %s", name, body)
		require.NotContains(t, body, `id="identity"`, name)
		require.NotContains(t, body, `<dd id="token">`, name)
	}
	require.Contains(t, logs.String(), `"reason":"proxy header without the proxy's secret"`)

	code, body := consoleGet(t, browser, u, "X-Auth-Request-User", "alice@ops.example.com", console.ProxySecretHeader, testProxySecret)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
	require.Contains(t, body, `<dd id="token">`+strconv.FormatInt(claimed.GetToken(), 10)+`</dd>`)
	require.Contains(t, logs.String(), `"via":"proxy"`)
	require.NotContains(t, logs.String(), testProxySecret, "the secret is never logged")

	code, body = consoleGet(t, browser, u)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="proxy-sign-in"`, "without the proxy's header: the sign-in page, which sends the operator to the proxy")
	require.NotContains(t, body, `name="token"`, "no token form: no identity has a token")
}

// claimEventually claims charge:order-42 for billing.payment-worker once
// serve answers.
func claimEventually(t *testing.T, c idemregv1.RegistryServiceClient) *idemregv1.ClaimResponse {
	t.Helper()
	var (
		claimed *idemregv1.ClaimResponse
		err     error
	)
	require.Eventually(t, func() bool {
		claimed, err = c.Claim(t.Context(), &idemregv1.ClaimRequest{
			Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:order-42", Holder: "worker-42"})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)
	return claimed
}

// syncWriter collects serve's logs from its goroutines.
type syncWriter struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncWriter) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestServeConsole runs serve with --console-listen and a config file with
// a token identity: the console signs in with the token and shows a record
// claimed through the gRPC listener.
func TestServeConsole(t *testing.T) {
	const token = "console-oncall-token"
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte("identities:\n  - name: oncall\n    token_hashes: [\""+access.HashToken(token)+"\"]\n    consumers: [\"billing.*\"]\n    admin: [\"billing.*\"]\n"), 0o600))
	listen, consoleAddr := servetest.FreeAddr(t), servetest.FreeAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	logs := &syncWriter{}
	go func() {
		done <- run(ctx, []string{"serve", "--listen", listen, "--data-dir", filepath.Join(dir, "data"), "--config", cfgFile,
			"--sweep-interval", "0", "--console-listen", consoleAddr}, io.Discard, logs)
	}()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	conn, err := grpc.NewClient(listen, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	callCtx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	var claimed *idemregv1.ClaimResponse
	require.Eventually(t, func() bool {
		claimed, err = idemregv1.NewRegistryServiceClient(conn).Claim(callCtx, &idemregv1.ClaimRequest{
			Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:order-42", Holder: "worker-42"})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)

	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	browser := &http.Client{Jar: jar}
	base := "http://" + consoleAddr
	res, err := browser.PostForm(base+"/signin", url.Values{"token": {token}})
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode, string(body))
	require.Contains(t, string(body), `<b id="identity">oncall</b>`)
	require.Contains(t, string(body), `<dd id="sweep-lag">none: no stored record has expired yet</dd>`, "the lag is read from the store")

	res, err = browser.Get(base + "/record?" + url.Values{"consumer": {"billing.payment-worker"}, "kind": {"KIND_OPERATION"}, "key": {"charge:order-42"}}.Encode())
	require.NoError(t, err)
	body, err = io.ReadAll(res.Body)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode, string(body))
	require.Contains(t, string(body), `<dd id="holder">worker-42</dd>`)
	require.Contains(t, string(body), `<dd id="token">`+strconv.FormatInt(claimed.GetToken(), 10)+`</dd>`)
	require.NotContains(t, logs.String(), token, "the token is never logged")
}
