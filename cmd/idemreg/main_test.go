package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// built is the binary the tests run, built once per test process: linking
// a -race binary takes seconds, and every test of the binary needs one.
// TestMain removes it.
var built struct {
	once     sync.Once
	dir, bin string
	out      []byte
	err      error
}

// buildBinary builds idemreg once per test run.
func buildBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "idemreg-test-"); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "idemreg")
		built.out, built.err = exec.Command("go", "build", "-race", "-o", built.bin, ".").CombinedOutput()
	})
	require.NoError(t, built.err, "go build: %s", built.out)
	return built.bin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close())
	return addr
}

// process is a running `idemreg serve` and the log lines it printed.
type process struct {
	cmd  *exec.Cmd
	logs chan map[string]any
	addr string
}

func startServe(t *testing.T, bin, dir string, env []string, args ...string) *process {
	t.Helper()
	addr := freeAddr(t)
	cmd := exec.Command(bin, append([]string{"serve", "--listen", addr}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Dir = dir
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &process{cmd: cmd, logs: make(chan map[string]any, 1000), addr: addr}
	go func() {
		defer close(p.logs)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				line = map[string]any{"msg": "unstructured: " + sc.Text()}
			}
			p.logs <- line
		}
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return p
}

// waitLog waits for a log line with the given message.
func (p *process) waitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-p.logs:
			require.True(t, ok, "idemreg exited before logging %q", msg)
			if line["msg"] == msg {
				return line
			}
		case <-timeout:
			t.Fatalf("idemreg did not log %q", msg)
		}
	}
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// TestServeEmbeddedDefaults runs the binary as the README's quick start does
// (no flags but the listen address) and checks a Claim, health, and a
// graceful stop on SIGTERM.
func TestServeEmbeddedDefaults(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	p := startServe(t, bin, dir, nil)
	p.waitLog(t, "serving")

	conn := dial(t, p.addr)
	c := idemregv1.NewRegistryServiceClient(conn)
	res, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
	h, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, h.GetStatus())

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	p.waitLog(t, "stopped")
	require.NoError(t, p.cmd.Wait(), "SIGTERM is a clean exit")
	require.DirExists(t, filepath.Join(dir, "idemreg-data"), "the embedded store lives in ./idemreg-data by default")
}

// TestServePostgres migrates a fresh database through the binary, serves on
// it with the URL from the environment, and sees the record survive a
// restart.
func TestServePostgres(t *testing.T) {
	bin := buildBinary(t)
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
		p := startServe(t, bin, t.TempDir(), env)
		line := p.waitLog(t, "opening SQL store")
		require.NotContains(t, line["database_url"], "secret", "the URL is logged redacted")
		p.waitLog(t, "serving")
		c := idemregv1.NewRegistryServiceClient(dial(t, p.addr))
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
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
		require.NoError(t, p.cmd.Wait())
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
