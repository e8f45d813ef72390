package faults

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
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
}
