// Package servetest runs `idemreg serve` as a process, for the tests of
// the binary (cmd/idemreg) and of the tests module (tests/faults,
// tests/adversarial): the binary built once per test process, a server
// started on a free loopback port, its JSON log lines read as they come,
// waited on, stopped or killed, and the last of them shown when the test
// fails. One harness, so that a change to how serve starts or logs is
// made once (etcd keeps its tests/framework/e2e for the same reason).
//
// It lives under the root module's internal/ so that only this
// repository's packages import it; the tests module's packages do, their
// import paths being under github.com/idemreg/idemreg.
package servetest

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// built is the binary the tests run, built once per test process: linking
// a -race binary takes seconds, and every test of the binary needs one.
var built struct {
	once     sync.Once
	dir, bin string
	out      []byte
	err      error
}

// Binary builds idemreg with -race once per test process and returns its
// path; Main removes it. It builds in the root module's directory, so
// that the binary links the versions the root module's go.mod selects
// (what make build ships), also when the test belongs to the tests
// module, whose own requirements could raise them.
func Binary(t testing.TB) string {
	t.Helper()
	built.once.Do(func() {
		var root string
		if root, built.err = rootDir(); built.err != nil {
			return
		}
		if built.dir, built.err = os.MkdirTemp("", "idemreg-test-"); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "idemreg")
		cmd := exec.Command("go", "build", "-race", "-o", built.bin, "./cmd/idemreg")
		cmd.Dir = root
		built.out, built.err = cmd.CombinedOutput()
	})
	require.NoError(t, built.err, "go build: %s", built.out)
	return built.bin
}

// RootDir is the directory of module github.com/idemreg/idemreg: this
// checkout's root, from the root module and, by its replace directive,
// from the tests module.
func RootDir(t testing.TB) string {
	t.Helper()
	dir, err := rootDir()
	require.NoError(t, err, "go list -m github.com/idemreg/idemreg")
	require.FileExists(t, filepath.Join(dir, "cmd", "idemreg", "main.go"))
	return dir
}

func rootDir() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemreg/idemreg").Output()
	return strings.TrimSpace(string(out)), err
}

// Main runs m's tests and removes the binary Binary built: the TestMain
// of a package that uses Binary.
func Main(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// FreeAddr is a loopback address nothing listens on (for as long as no
// one else takes it).
func FreeAddr(t testing.TB) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close())
	return addr
}

// Dial is a plaintext client connection to addr, closed when t ends.
func Dial(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Options says how to start serve.
type Options struct {
	Bin string   // the binary; Binary's when empty
	Dir string   // the working directory; a new t.TempDir when empty
	Env []string // added to the test's environment
	// Addr is the --listen address; a free one when empty. A test that
	// restarts serve where its clients already dial gives the old one.
	Addr string
	// Args follow `serve --listen <Addr>`.
	Args []string
	// Observe, when set, sees every line serve writes as it comes, as
	// text and as its JSON (nil when it is not JSON): for a test that
	// counts what serve logs for as long as it runs. Logs then drops
	// the lines its buffer has no room for rather than stall serve on
	// its stderr.
	Observe func(text string, line map[string]any)
}

// tailLines is how many of serve's last lines a failed test shows.
const tailLines = 100

// Process is a running `idemreg serve`.
type Process struct {
	Cmd  *exec.Cmd
	Addr string // its --listen address
	// Logs carries serve's log lines, each line's JSON (an unstructured
	// line as {"msg": "unstructured: <line>"}), and is closed when serve
	// closes its stderr. Its buffer is bounded: a test that lets serve
	// log much more without reading sets Quiet or Options.Observe.
	Logs chan map[string]any
	// Quiet drops the lines of each call (the access log, the store's
	// refusals) before they reach Logs, so that a test making thousands
	// of calls does not fill it and stall serve on its stderr.
	Quiet atomic.Bool

	exited chan struct{}
	mu     sync.Mutex
	tail   [tailLines]string // a ring of the last lines
	lines  int               // lines read so far
}

// Start starts `bin serve --listen <free address> args...` in dir, with
// env added to the environment. The process is killed when t ends, if it
// has not been waited for; when t failed, serve's last lines are logged.
func Start(t testing.TB, bin, dir string, env []string, args ...string) *Process {
	t.Helper()
	return StartWith(t, Options{Bin: bin, Dir: dir, Env: env, Args: args})
}

// StartWith is Start with Options.
func StartWith(t testing.TB, o Options) *Process {
	t.Helper()
	if o.Bin == "" {
		o.Bin = Binary(t)
	}
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	addr := o.Addr
	if addr == "" {
		addr = FreeAddr(t)
	}
	cmd := exec.Command(o.Bin, append([]string{"serve", "--listen", addr}, o.Args...)...)
	cmd.Env = append(os.Environ(), o.Env...)
	cmd.Dir = o.Dir
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &Process{Cmd: cmd, Addr: addr, Logs: make(chan map[string]any, 1000), exited: make(chan struct{})}
	go p.read(stderr, o.Observe)
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		// Wait closed the pipe; the reader may still be blocked on a
		// full Logs: drain it until the reader has read every line.
		for range p.Logs {
		}
		<-p.exited
		if t.Failed() {
			p.logTail(t)
		}
	})
	return p
}

func (p *Process) read(stderr io.Reader, observe func(string, map[string]any)) {
	defer close(p.exited)
	defer close(p.Logs)
	sc := bufio.NewScanner(stderr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		text := sc.Text()
		p.keep(text)
		var line map[string]any
		if json.Unmarshal(sc.Bytes(), &line) != nil {
			line = nil
		}
		if observe != nil {
			observe(text, line)
		}
		if line == nil {
			line = map[string]any{"msg": "unstructured: " + text}
		}
		if p.Quiet.Load() {
			switch line["msg"] {
			case "finished call", "store capacity exhausted", "store failed":
				continue
			}
		}
		if observe == nil {
			p.Logs <- line
			continue
		}
		select {
		case p.Logs <- line:
		default: // an observing test reads Logs little, if at all
		}
	}
}

// keep remembers text among the last tailLines lines.
func (p *Process) keep(text string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.tail[p.lines%tailLines] = text
	p.lines++
}

func (p *Process) logTail(t testing.TB) {
	p.mu.Lock()
	defer p.mu.Unlock()
	first := max(0, p.lines-tailLines)
	tail := make([]string, 0, p.lines-first)
	for i := first; i < p.lines; i++ {
		tail = append(tail, p.tail[i%tailLines])
	}
	t.Logf("idemreg serve (%s) wrote %d lines; the last %d:\n%s", p.Addr, p.lines, len(tail), strings.Join(tail, "\n"))
}

// Exited is closed when serve has closed its stderr: it exited (or handed
// its stderr on, which it does not).
func (p *Process) Exited() <-chan struct{} { return p.exited }

// WaitLog waits up to 30 seconds for a log line with the given message,
// dropping the lines before it, and returns it.
func (p *Process) WaitLog(t testing.TB, msg string) map[string]any {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-p.Logs:
			require.True(t, ok, "idemreg exited before logging %q", msg)
			if line["msg"] == msg {
				return line
			}
		case <-timeout:
			t.Fatalf("idemreg did not log %q", msg)
		}
	}
}

// Stop sends serve SIGTERM and waits for it to exit, which must be a
// clean exit.
func (p *Process) Stop(t testing.TB) {
	t.Helper()
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait(), "SIGTERM is a clean exit")
}

// Kill sends serve SIGKILL, as a crash would, and waits for it to go.
func (p *Process) Kill(t testing.TB) {
	t.Helper()
	require.NoError(t, p.Cmd.Process.Kill())
	_ = p.Cmd.Wait() // killed: the error says so
}
