package faults

import (
	"bufio"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// built is the binary the tests run, built once per test process: linking
// a -race binary takes seconds. TestMain removes it.
var built struct {
	once     sync.Once
	dir, bin string
	out      []byte
	err      error
}

// buildBinary builds idemreg once per test run. It builds in the root
// module's directory, so that the binary links the versions the root
// module's go.mod selects (what make build ships), not the ones this
// module's own requirements could raise.
func buildBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "idemreg-test-"); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "idemreg")
		cmd := exec.Command("go", "build", "-race", "-o", built.bin, "./cmd/idemreg")
		cmd.Dir = rootDir(t)
		built.out, built.err = cmd.CombinedOutput()
	})
	require.NoError(t, built.err, "go build: %s", built.out)
	return built.bin
}

// rootDir is the directory of module github.com/idemreg/idemreg: this
// checkout's root, by the tests module's replace directive.
func rootDir(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemreg/idemreg").Output()
	require.NoError(t, err, "go list -m github.com/idemreg/idemreg")
	dir := strings.TrimSpace(string(out))
	require.FileExists(t, filepath.Join(dir, "cmd", "idemreg", "main.go"))
	return dir
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
	// quiet drops the lines of each call (the access log, the refusals'
	// warnings) before they reach logs, so that a test making thousands
	// of calls does not fill it and stall serve on its stderr.
	quiet atomic.Bool
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
			if p.quiet.Load() {
				switch line["msg"] {
				case "finished call", "store capacity exhausted", "store failed":
					continue
				}
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
