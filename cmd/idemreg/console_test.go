package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// TestConsoleListenLoopbackOnly: the console speaks plaintext HTTP, so
// --console-listen takes a loopback address unless --console-allow-remote
// says otherwise.
func TestConsoleListenLoopbackOnly(t *testing.T) {
	cases := []struct {
		name    string
		args    []string
		refused bool
	}{
		{"loopback", []string{"--console-listen", "127.0.0.1:7351"}, false},
		{"IPv6 loopback", []string{"--console-listen", "[::1]:7351"}, false},
		{"every interface", []string{"--console-listen", ":7351"}, true},
		{"another interface", []string{"--console-listen", "10.0.0.1:7351"}, true},
		{"remote allowed explicitly", []string{"--console-listen", "0.0.0.0:7351", "--console-allow-remote"}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := defaultConfig()
			fs := flag.NewFlagSet("idemreg serve", flag.ContinueOnError)
			cfg.bindServe(fs)
			require.NoError(t, parse(fs, tc.args))
			err := cfg.Validate()
			if !tc.refused {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, "--console-listen "+tc.args[1]+" is not a loopback address")
			require.ErrorContains(t, runBriefly(t, "serve", tc.args...), "--console-allow-remote")
		})
	}
}

// TestServeConsoleRefuses: serve does not start a console it cannot make
// act as the operator.
func TestServeConsoleRefuses(t *testing.T) {
	dir := t.TempDir()
	certOnly := filepath.Join(dir, "certs.yaml")
	require.NoError(t, os.WriteFile(certOnly, []byte("identities:\n  - name: svc\n    dns_names: [svc.example]\n    admin: [\"billing.*\"]\n"), 0o600))
	err := runBriefly(t, "serve", "--console-listen", freeAddr(t), "--config", certOnly, "--sweep-interval", "0")
	require.ErrorContains(t, err, "authenticate by client certificate, which the console cannot forward yet")
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
	listen, consoleAddr := freeAddr(t), freeAddr(t)
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
