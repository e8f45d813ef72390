package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// connectError is the Connect protocol's JSON error.
type connectError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Details []struct {
		Type  string `json:"type"`
		Value string `json:"value"`
	} `json:"details"`
}

// detail decodes the error's detail of m's type into m.
func (e connectError) detail(t *testing.T, m proto.Message) {
	t.Helper()
	name := string(m.ProtoReflect().Descriptor().FullName())
	for _, d := range e.Details {
		if d.Type == name {
			b, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(d.Value, "="))
			require.NoError(t, err)
			require.NoError(t, proto.Unmarshal(b, m))
			return
		}
	}
	t.Fatalf("no %s in %+v", name, e)
}

// postJSON POSTs body to the method as a plain JSON request (what the
// README's curl examples send) and returns the status and the decoded
// answer.
func postJSON(t *testing.T, hc *http.Client, base, method, body string, header ...string) (int, map[string]any, connectError) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/idemreg.v1.RegistryService/"+method, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := hc.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	var ok map[string]any
	var ce connectError
	if res.StatusCode == http.StatusOK {
		require.NoError(t, json.Unmarshal(b, &ok), "%s", b)
	} else {
		require.Equal(t, "application/json", res.Header.Get("Content-Type"), "%s", b)
		require.NoError(t, json.Unmarshal(b, &ce), "%s", b)
	}
	return res.StatusCode, ok, ce
}

// TestHTTPAPI drives a Claim, a Complete and the replay over plain
// HTTP/1.1 JSON on the gRPC port (the README's curl examples), checks the
// errors' details, gRPC-Web, and that gRPC still answers on the same port.
func TestHTTPAPI(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	metricsAddr := servetest.FreeAddr(t)
	p := servetest.Start(t, bin, dir, nil, "--data-dir", filepath.Join(dir, "data"), "--metrics-listen", metricsAddr,
		"--http-api-cors-origins", "https://app.example.com")
	p.WaitLog(t, "serving")
	base, hc := "http://"+p.Addr, &http.Client{}

	claim := `{"consumer":"billing.payment-worker","kind":"KIND_OPERATION","key":"charge:order-42","fingerprint":"aGFzaC0x","lease":"30s"}`
	code, first, _ := postJSON(t, hc, base, "Claim", claim)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "OUTCOME_ACQUIRED", first["outcome"])
	token, secret := first["token"].(string), first["claimSecret"].(string)
	require.NotEmpty(t, token)
	require.NotEmpty(t, secret)

	_, again, _ := postJSON(t, hc, base, "Claim", claim)
	require.Equal(t, "OUTCOME_IN_PROGRESS", again["outcome"])

	code, _, _ = postJSON(t, hc, base, "Complete", `{"consumer":"billing.payment-worker","kind":"KIND_OPERATION",
		"key":"charge:order-42","token":"`+token+`","claimSecret":"`+secret+`",
		"result":{"response":{"type":"payments.v1.Charge","data":"Y2hhcmdlLTE="}}}`)
	require.Equal(t, http.StatusOK, code)

	_, done, _ := postJSON(t, hc, base, "Claim", claim)
	require.Equal(t, "OUTCOME_COMPLETED", done["outcome"])
	resp := done["record"].(map[string]any)["result"].(map[string]any)["response"].(map[string]any)
	require.Equal(t, "Y2hhcmdlLTE=", resp["data"])

	// Errors: the Connect JSON error with the gRPC error's details.
	code, _, ce := postJSON(t, hc, base, "Claim", strings.Replace(claim, "aGFzaC0x", "aGFzaC0y", 1))
	require.Equal(t, http.StatusBadRequest, code)
	require.Equal(t, "failed_precondition", ce.Code)
	var info errdetails.ErrorInfo
	ce.detail(t, &info)
	require.Equal(t, "FINGERPRINT_MISMATCH", info.GetReason())
	require.Equal(t, "idemreg.dev", info.GetDomain())

	code, _, ce = postJSON(t, hc, base, "Claim", `{"consumer":"c","kind":"KIND_MESSAGE","key":"`+strings.Repeat("k", 300)+`"}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Equal(t, "invalid_argument", ce.Code)
	var bad errdetails.BadRequest
	ce.detail(t, &bad)
	require.Equal(t, "key", bad.GetFieldViolations()[0].GetField())

	// The Connect protocol's own header is taken as well.
	code, _, _ = postJSON(t, hc, base, "Lookup", `{"consumer":"billing.payment-worker","kind":"KIND_OPERATION","key":"charge:order-42"}`,
		"Connect-Protocol-Version", "1")
	require.Equal(t, http.StatusOK, code)

	// gRPC-Web: a framed binary Lookup.
	msg, err := proto.Marshal(&idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:order-42"})
	require.NoError(t, err)
	frame := append([]byte{0}, binary.BigEndian.AppendUint32(nil, uint32(len(msg)))...)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/idemreg.v1.RegistryService/Lookup", bytes.NewReader(append(frame, msg...)))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/grpc-web+proto")
	res, err := hc.Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, "application/grpc-web+proto", res.Header.Get("Content-Type"))
	n := binary.BigEndian.Uint32(body[1:5])
	var lookup idemregv1.LookupResponse
	require.NoError(t, proto.Unmarshal(body[5:5+n], &lookup))
	require.Equal(t, idemregv1.State_STATE_COMPLETED, lookup.GetRecord().GetState())
	require.Contains(t, strings.ToLower(string(body[5+n:])), "grpc-status: 0")

	// A page of an allowed origin may call; another origin's gets no CORS
	// headers, so its browser refuses it the answer.
	preflight := func(origin string) http.Header {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodOptions, base+"/idemreg.v1.RegistryService/Claim", nil)
		require.NoError(t, err)
		req.Header.Set("Origin", origin)
		req.Header.Set("Access-Control-Request-Method", "POST")
		req.Header.Set("Access-Control-Request-Headers", "content-type,connect-protocol-version,authorization")
		res, err := hc.Do(req)
		require.NoError(t, err)
		_ = res.Body.Close()
		return res.Header
	}
	h := preflight("https://app.example.com")
	require.Equal(t, "https://app.example.com", h.Get("Access-Control-Allow-Origin"))
	require.Contains(t, h.Get("Access-Control-Allow-Headers"), "Authorization")
	require.Contains(t, h.Get("Access-Control-Allow-Headers"), "Connect-Protocol-Version")
	require.Empty(t, preflight("https://evil.example.com").Get("Access-Control-Allow-Origin"))
	req, err = http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/idemreg.v1.RegistryService/Lookup",
		strings.NewReader(`{"consumer":"billing.payment-worker","kind":"KIND_OPERATION","key":"charge:order-42"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Origin", "https://app.example.com")
	res, err = hc.Do(req)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, "https://app.example.com", res.Header.Get("Access-Control-Allow-Origin"))
	require.Contains(t, res.Header.Get("Access-Control-Expose-Headers"), "Grpc-Status")

	// Any other path is no API call: 404, and the connection closed.
	res, err = hc.Get(base + "/")
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusNotFound, res.StatusCode)
	require.True(t, res.Close, "the connection of a request for no API path is closed")

	// The access log and the metrics have the HTTP calls, as gRPC calls.
	for {
		line := p.WaitLog(t, "finished call")
		if line["grpc.method"] == "Complete" {
			require.Equal(t, "OK", line["grpc.code"])
			require.Equal(t, "anonymous", line["identity"])
			break
		}
	}
	res, err = http.Get("http://" + metricsAddr + "/metrics")
	require.NoError(t, err)
	metrics, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Contains(t, string(metrics), `rpc_method="idemreg.v1.RegistryService/Complete",rpc_response_status_code="OK"`)
	require.Contains(t, string(metrics), `rpc_method="idemreg.v1.RegistryService/Claim",rpc_response_status_code="FAILED_PRECONDITION"`)

	// gRPC on the same port, as before.
	conn, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	got, err := idemregv1.NewRegistryServiceClient(conn).Lookup(t.Context(),
		&idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:order-42"})
	require.NoError(t, err)
	require.Equal(t, idemregv1.State_STATE_COMPLETED, got.GetRecord().GetState())
}

// TestHTTPAPIOverTLS: with TLS, an HTTPS client (which offers http/1.1)
// reaches the HTTP API and a gRPC client (h2 only) reaches gRPC, on one
// port; a client certificate, or a bearer token, is the same identity on
// both, and a call without credentials is refused.
func TestHTTPAPIOverTLS(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	testCA(t, dir, map[string]string{"billing": "spiffe://test/billing"})
	const token = "idemreg_s3cr3t-t0ken-for-tests"
	configPath := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(configPath, []byte(`
identities:
  - {name: billing, uris: ["spiffe://test/billing"], consumers: ["billing.*"]}
  - {name: orders, token_hashes: ["`+access.HashToken(token)+`"], consumers: ["orders.*"]}
`), 0o600))
	serve := func(args ...string) string {
		p := servetest.Start(t, bin, dir, nil, append([]string{"--data-dir", t.TempDir(), "--config", configPath,
			"--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server-key.pem")}, args...)...)
		p.WaitLog(t, "serving")
		return p.Addr
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(caPEM))
	httpsClient := func(certs ...tls.Certificate) *http.Client {
		return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: certs}, ForceAttemptHTTP2: true}}
	}
	claim := func(consumer string) string {
		return `{"consumer":"` + consumer + `","kind":"KIND_MESSAGE","key":"m-1"}`
	}

	t.Run("client certificates", func(t *testing.T) {
		addr := serve("--tls-client-ca", filepath.Join(dir, "ca.pem"))
		base := "https://" + addr
		cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "billing.pem"), filepath.Join(dir, "billing-key.pem"))
		require.NoError(t, err)
		code, ok, _ := postJSON(t, httpsClient(cert), base, "Claim", claim("billing.worker"))
		require.Equal(t, http.StatusOK, code, "the client certificate is the billing identity")
		require.Equal(t, "OUTCOME_ACQUIRED", ok["outcome"])
		code, _, ce := postJSON(t, httpsClient(cert), base, "Claim", claim("orders.inbox"))
		require.Equal(t, http.StatusForbidden, code)
		require.Equal(t, "permission_denied", ce.Code)

		_, err = idemregv1.NewRegistryServiceClient(mtlsConn(t, dir, "billing", addr)).Claim(t.Context(),
			&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-2"})
		require.NoError(t, err, "gRPC over TLS on the same port")
	})

	t.Run("bearer tokens", func(t *testing.T) {
		base := "https://" + serve()
		code, _, ce := postJSON(t, httpsClient(), base, "Claim", claim("orders.inbox"))
		require.Equal(t, http.StatusUnauthorized, code, "%+v", ce)
		require.Equal(t, "unauthenticated", ce.Code)
		code, ok, _ := postJSON(t, httpsClient(), base, "Claim", claim("orders.inbox"), "Authorization", "Bearer "+token)
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "OUTCOME_ACQUIRED", ok["outcome"])
		code, _, ce = postJSON(t, httpsClient(), base, "Claim", claim("billing.worker"), "Authorization", "Bearer "+token)
		require.Equal(t, http.StatusForbidden, code)
		require.Equal(t, "permission_denied", ce.Code)
	})
}
