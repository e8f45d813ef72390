package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/servetest"
)

// leaked reports whether s shows any of the test's password.
func leaked(s string) bool { return strings.Contains(s, "S3cretP") }

// secretURLs hold the password S3cretPw in every form a connection string
// can carry it; none is reachable (port 1) or parseable.
var secretURLs = []struct{ name, url string }{
	{"URL userinfo", "postgres://u:S3cretPw@127.0.0.1:1/db?sslmode=disable&connect_timeout=1"},
	{"password parameter", "postgres://u@127.0.0.1:1/db?sslmode=disable&connect_timeout=1&password=S3cretPw"},
	{"sslpassword parameter", "postgres://u@127.0.0.1:1/db?sslmode=disable&connect_timeout=1&sslpassword=S3cretPw"},
	{"password parameter, bad parameter", "postgres://u@127.0.0.1:1/db?password=S3cretPw&connect_timeout=x"},
	{"unparseable URL", "postgres://u:S3cretPw@127.0.0.1:badport/db"},
	{"key=value", "host=127.0.0.1 port=1 user=u password=S3cretPw"},
	{"key = value", "host=127.0.0.1 port=1 user=u password = S3cretPw"},
}

// TestSecretsNeverPrinted runs migrate and serve with each form of
// database URL, as a flag and from the environment: whatever they fail
// with or log, the password is not in it.
func TestSecretsNeverPrinted(t *testing.T) {
	for _, tc := range secretURLs {
		for _, cmd := range []string{"migrate", "serve"} {
			for _, from := range []string{"flag", "env"} {
				t.Run(tc.name+"/"+cmd+"/"+from, func(t *testing.T) {
					args := []string{cmd}
					if cmd == "serve" {
						args = append(args, "--listen", servetest.FreeAddr(t), "--data-dir", filepath.Join(t.TempDir(), "data"), "--sweep-interval", "0")
					}
					if from == "flag" {
						args = append(args, "--database-url", tc.url)
					} else {
						t.Setenv("IDEMREG_DATABASE_URL", tc.url)
					}
					var out, errOut bytes.Buffer
					// serve runs until the context ends when the URL parses:
					// the store connects on demand.
					ctx, cancel := context.WithTimeout(t.Context(), time.Second)
					defer cancel()
					err := run(ctx, args, &out, &errOut)
					if err != nil {
						require.False(t, leaked(err.Error()), "error: %v", err)
					}
					require.False(t, leaked(out.String()), "stdout: %s", out.String())
					require.False(t, leaked(errOut.String()), "stderr: %s", errOut.String())
					require.True(t, err != nil || cmd == "serve", "migrate cannot reach the database")
					if cmd == "serve" && strings.Contains(errOut.String(), "opening SQL store") {
						require.Contains(t, errOut.String(), "xxxxx", "the URL is logged, redacted")
					}
				})
			}
		}
	}
}

// TestPprofCmdlineRedacted runs the binary with --pprof-listen and a
// database URL carrying its password twice: /debug/pprof/cmdline shows the
// command line without it, and no log line shows it.
func TestPprofCmdlineRedacted(t *testing.T) {
	bin := servetest.Binary(t)
	pprofAddr := servetest.FreeAddr(t)
	dbURL := "postgres://u:S3cretPw@127.0.0.1:1/db?sslmode=disable&password=S3cretPw2"
	p := servetest.Start(t, bin, t.TempDir(), nil, "--pprof-listen", pprofAddr, "--database-url", dbURL, "--sweep-interval", "0")
	for _, msg := range []string{"pprof serving", "opening SQL store"} {
		for line := range p.Logs {
			b, err := json.Marshal(line)
			require.NoError(t, err)
			require.False(t, leaked(string(b)), "log line: %s", b)
			if line["msg"] == msg {
				break
			}
		}
	}
	res, err := http.Get("http://" + pprofAddr + "/debug/pprof/cmdline")
	require.NoError(t, err)
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	args := strings.Split(string(body), "\x00")
	require.False(t, leaked(string(body)), "cmdline: %q", body)
	require.Equal(t, []string{bin, "serve", "--listen", p.Addr, "--pprof-listen", pprofAddr, "--database-url",
		"postgres://u:xxxxx@127.0.0.1:1/db?sslmode=disable&password=xxxxx", "--sweep-interval", "0"}, args)
}

// TestPprofListenLoopbackOnly: pprof has no authentication, so serve
// refuses --pprof-listen on an address that is not loopback, from a flag or
// the environment, before it listens on anything, unless
// --pprof-allow-remote says otherwise (each address's verdict is config's
// TestListenersLoopbackOnly).
func TestPprofListenLoopbackOnly(t *testing.T) {
	require.ErrorContains(t, runBriefly(t, "serve", "--pprof-listen", "0.0.0.0:6060"), "--pprof-listen 0.0.0.0:6060 is not a loopback address")
	t.Setenv("IDEMREG_PPROF_LISTEN", "0.0.0.0:6060")
	require.ErrorContains(t, runBriefly(t, "serve"), "--pprof-allow-remote")
}

// runBriefly runs a command in its own data directory for at most two
// seconds (a serve that should have refused to start stops then).
func runBriefly(t *testing.T, cmd string, args ...string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	return run(ctx, append([]string{cmd, "--data-dir", filepath.Join(t.TempDir(), "data"), "--listen", servetest.FreeAddr(t)}, args...), io.Discard, io.Discard)
}
