package main

import (
	"bytes"
	"context"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

func TestMain(m *testing.M) { servetest.Main(m) }

// TestServeEmbeddedDefaults runs the binary as the README's quick start does
// (no flags but the listen address) and checks a Claim, health, and a
// graceful stop on SIGTERM.
func TestServeEmbeddedDefaults(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	p := servetest.Start(t, bin, dir, nil)
	p.WaitLog(t, "serving")

	conn := servetest.Dial(t, p.Addr)
	c := idemregv1.NewRegistryServiceClient(conn)
	res, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
	h, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, h.GetStatus())

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	p.WaitLog(t, "stopped")
	require.NoError(t, p.Cmd.Wait(), "SIGTERM is a clean exit")
	require.DirExists(t, filepath.Join(dir, "idemreg-data"), "the embedded store lives in ./idemreg-data by default")
}

// TestServePostgres migrates a fresh database through the binary, serves on
// it with the URL from the environment, and sees the record survive a
// restart.
func TestServePostgres(t *testing.T) {
	bin := servetest.Binary(t)
	u, err := url.Parse(pgtest.NewEmptyDatabase(t))
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "secret") // trust auth ignores it; logs must not show it
	env := []string{"IDEMREG_DATABASE_URL=" + u.String()}

	for i := range 2 { // migrate is idempotent
		cmd := exec.Command(bin, "migrate")
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "migrate: %s", out)
		require.NotContains(t, string(out), ":secret@", "the URL is printed redacted")
		if i == 0 {
			require.Contains(t, string(out), "applied 0001_records.sql")
			require.NotContains(t, string(out), "up to date", "it applied every migration")
		} else {
			require.Contains(t, string(out), "schema is up to date")
		}
	}

	var token int64
	for i := range 2 {
		p := servetest.Start(t, bin, t.TempDir(), env)
		line := p.WaitLog(t, "opening SQL store")
		require.NotContains(t, line["database_url"], "secret", "the URL is logged redacted")
		p.WaitLog(t, "serving")
		c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
		req := &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_OPERATION, Key: "op-1"}
		res, err := c.Claim(t.Context(), req)
		require.NoError(t, err)
		if i == 0 {
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
			token = res.GetToken()
			_, err = c.Complete(t.Context(), &idemregv1.CompleteRequest{Consumer: req.Consumer, Kind: req.Kind, Key: req.Key, Token: token, ClaimSecret: res.GetClaimSecret(),
				Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "t", Data: []byte("d")}}}})
			require.NoError(t, err)
		} else {
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome())
			require.Equal(t, token, res.GetRecord().GetToken())
		}
		require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
		require.NoError(t, p.Cmd.Wait())
	}
}

func TestConfigErrors(t *testing.T) {
	cases := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"unknown command", []string{"frobnicate"}, nil, `unknown command "frobnicate"`},
		{"no command", nil, nil, "no command given"},
		{"bench moved out", []string{"bench", "--targets", "idemreg"}, nil, "go run ./cmd/idemreg-bench"},
		{"bad database url", []string{"serve", "--database-url", "mysql://x"}, nil, "--database-url must be a postgres:// URL"},
		{"bad limits", []string{"serve", "--min-lease", "1h", "--max-lease", "1m"}, nil, "lease bounds"},
		{"bad env", []string{"serve"}, map[string]string{"IDEMREG_DEFAULT_LEASE": "soon"}, "IDEMREG_DEFAULT_LEASE"},
		{"migrate without url", []string{"migrate"}, nil, "migrate needs --database-url"},
		{"password redacted", []string{"serve", "--database-url", "mysql://u:secret@h/db"}, nil, "xxxxx"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("IDEMREG_DATABASE_URL", "")
			os.Unsetenv("IDEMREG_DATABASE_URL")
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var out, errOut bytes.Buffer
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			err := run(ctx, tc.args, &out, &errOut)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "secret")
		})
	}
}

func TestHelp(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"help"}, &out, &out))
	require.True(t, strings.HasPrefix(out.String(), "idemreg:"))
}
