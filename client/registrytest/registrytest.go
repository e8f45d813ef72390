// Package registrytest runs a real idemreg registry for a test: the
// `idemreg serve` binary as a child process, on a free loopback port, over
// the embedded store in a temporary directory, and a client connected to
// it. Use it to test code built on client.Once or the interceptors
// against the real thing instead of a mock.
//
// It imports only package client, gRPC and the standard library, so a
// service's module that imports it in a _test.go gains no requirement of
// the registry's (its server, storage engines, telemetry) and keeps its go
// line. The binary comes from $IDEMREG_BIN, this checkout, PATH, or a
// `go install` of the release this package names (Binary says which, in
// that order).
package registrytest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/client"
)

// Limits are the registry's request bounds and defaults, each passed to
// serve as the flag of the same name (MinLease is --min-lease);
// DefaultLimits returns serve's defaults.
type Limits struct {
	// DefaultLease applies when a Claim or Extend gives none.
	DefaultLease time.Duration
	// MinLease and MaxLease bound a requested lease.
	MinLease, MaxLease time.Duration
	// MaxLeaseTotal bounds how long one attempt may hold a key, its
	// Claim's lease and every Extend together; zero means no bound.
	MaxLeaseTotal time.Duration
	// DefaultMessageRetention and DefaultOperationRetention apply when a
	// Claim gives none, by kind.
	DefaultMessageRetention, DefaultOperationRetention time.Duration
	// MinRetention and MaxRetention bound a requested retention.
	MinRetention, MaxRetention time.Duration
	// MaxResultBytes bounds the encoded size of a stored result.
	MaxResultBytes int
}

// DefaultLimits returns the limits of a registry started without
// WithLimits: serve's defaults, documented in docs/semantics.md (this
// package's tests check them against `idemreg serve -h`).
func DefaultLimits() Limits {
	return Limits{
		DefaultLease:              30 * time.Second,
		MinLease:                  time.Second,
		MaxLease:                  time.Hour,
		MaxLeaseTotal:             24 * time.Hour,
		DefaultMessageRetention:   7 * 24 * time.Hour,
		DefaultOperationRetention: 24 * time.Hour,
		MinRetention:              time.Minute,
		MaxRetention:              30 * 24 * time.Hour,
		MaxResultBytes:            1 << 20,
	}
}

func (l Limits) args() []string {
	d := func(name string, v time.Duration) string { return "--" + name + "=" + v.String() }
	return []string{
		d("default-lease", l.DefaultLease),
		d("min-lease", l.MinLease),
		d("max-lease", l.MaxLease),
		d("max-lease-total", l.MaxLeaseTotal),
		d("default-message-retention", l.DefaultMessageRetention),
		d("default-operation-retention", l.DefaultOperationRetention),
		d("min-retention", l.MinRetention),
		d("max-retention", l.MaxRetention),
		"--max-result-bytes=" + strconv.Itoa(l.MaxResultBytes),
	}
}

// Option configures New and Start.
type Option func(*config)

type config struct {
	limits     *Limits
	logger     *slog.Logger
	clientOpts []client.ClientOption
	addr       string
	args       []string
	dataDir    string
	startup    time.Duration
}

// WithLimits sets the registry's limits (default DefaultLimits()), for
// instance a MinLease below a second so a test can let leases run out fast.
func WithLimits(l Limits) Option { return func(c *config) { c.limits = &l } }

// WithLogger receives the registry's log lines (default: discarded), each
// at its level with its attributes; a line that is not serve's JSON comes
// as an error-level "idemreg output" record.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithClientOptions configures the Client of the Registry.
func WithClientOptions(opts ...client.ClientOption) Option {
	return func(c *config) { c.clientOpts = append(c.clientOpts, opts...) }
}

// WithAddress sets the listen address (default "127.0.0.1:0", a free port).
func WithAddress(addr string) Option { return func(c *config) { c.addr = addr } }

// WithArgs adds flags to `idemreg serve` after the ones this package
// passes, which they override: --config with a file of identities and
// rate limits, --max-in-flight, --wait-recheck and so on (`idemreg serve
// -h` lists them). A registry started with --tls-cert is not one Start
// can dial: use New's error, or dial Addr yourself.
func WithArgs(args ...string) Option {
	return func(c *config) { c.args = append(c.args, args...) }
}

// WithDataDir keeps the embedded store in dir (default: a new temporary
// directory, removed by Close), for a test that restarts a registry on
// the records of the last one.
func WithDataDir(dir string) Option { return func(c *config) { c.dataDir = dir } }

// WithStartTimeout bounds how long New waits for the registry to report
// its address and serve health (default 30 s).
func WithStartTimeout(d time.Duration) Option { return func(c *config) { c.startup = d } }

// Registry is a running registry and a client connected to it.
type Registry struct {
	// Addr is the host:port the registry listens on, for other processes.
	Addr string
	// Conn is connected to the registry; it stays open after Stop.
	Conn *grpc.ClientConn
	// Client is a client.Client on Conn.
	Client *client.Client
	// DataDir is the embedded store's directory.
	DataDir string

	cmd      *exec.Cmd
	tempDir  string // removed by Close; empty with WithDataDir
	exited   chan struct{}
	waitErr  error
	out      *tail
	stopOnce sync.Once
	stopErr  error
	closed   sync.Once
	closeErr error
}

// stopGrace is how long Stop waits after SIGTERM before it kills serve:
// serve drains for --shutdown-timeout (1 s here) and exits.
const stopGrace = 10 * time.Second

// New starts a registry. Close it when done.
func New(opts ...Option) (*Registry, error) {
	cfg := config{logger: slog.New(slog.DiscardHandler), addr: "127.0.0.1:0", startup: 30 * time.Second}
	for _, o := range opts {
		o(&cfg)
	}
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	r := &Registry{DataDir: cfg.dataDir, exited: make(chan struct{}), out: &tail{}}
	if r.DataDir == "" {
		if r.tempDir, err = os.MkdirTemp("", "registrytest-"); err != nil {
			return nil, fmt.Errorf("registrytest: %w", err)
		}
		r.DataDir = r.tempDir
	}
	args := []string{"serve",
		"--listen=" + cfg.addr,
		"--data-dir=" + r.DataDir,
		"--log-format=json",
		// A test's registry stops at once and takes what disk it finds
		// (a tmpfs /tmp is often below serve's 256 MiB reserve).
		"--drain-delay=0s", "--shutdown-timeout=1s", "--data-dir-reserve=-1",
	}
	if cfg.limits != nil {
		args = append(args, cfg.limits.args()...)
	}
	r.cmd = exec.Command(bin, append(args, cfg.args...)...)
	r.cmd.Env = childEnv()
	stderr, err := r.cmd.StderrPipe()
	if err != nil {
		r.removeTemp()
		return nil, fmt.Errorf("registrytest: %w", err)
	}
	r.cmd.Stdout = io.Discard
	if err := r.cmd.Start(); err != nil {
		r.removeTemp()
		return nil, fmt.Errorf("registrytest: start %s: %w", bin, err)
	}
	listening := make(chan string, 1)
	go r.read(stderr, cfg.logger, listening)
	go func() { r.waitErr = r.cmd.Wait(); close(r.exited) }()

	fail := func(err error) (*Registry, error) {
		_ = r.kill()
		r.removeTemp()
		return nil, fmt.Errorf("registrytest: %s: %w; its last output:\n%s", bin, err, r.out)
	}
	timer := time.NewTimer(cfg.startup)
	defer timer.Stop()
	select {
	case r.Addr = <-listening:
	case <-r.exited:
		return fail(fmt.Errorf("serve exited before it listened: %v", r.waitErr))
	case <-timer.C:
		return fail(fmt.Errorf("serve did not report its address within %v", cfg.startup))
	}
	if r.Conn, err = grpc.NewClient(r.Addr, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.startup)
	defer cancel()
	if err := waitServing(ctx, r.Conn, r.exited); err != nil {
		_ = r.Conn.Close()
		return fail(err)
	}
	r.Client = client.New(r.Conn, cfg.clientOpts...)
	return r, nil
}

// Start starts a registry for the test and closes it when the test ends.
func Start(t testing.TB, opts ...Option) *Registry {
	t.Helper()
	r, err := New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("registrytest: close: %v", err)
		}
		if t.Failed() {
			t.Logf("registrytest: the registry's last output:\n%s", r.out)
		}
	})
	return r
}

// Stop stops the registry as if it went down: serve gets SIGTERM (SIGKILL
// after 10 s), Conn stays open and calls through it fail with
// UNAVAILABLE. It reports how serve exited, and is safe to call more than
// once.
func (r *Registry) Stop() error {
	r.stopOnce.Do(func() {
		select {
		case <-r.exited:
			r.stopErr = fmt.Errorf("registrytest: serve had exited: %v", r.waitErr)
			return
		default:
		}
		if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			r.stopErr = errors.Join(err, r.kill())
			return
		}
		select {
		case <-r.exited:
			if r.waitErr != nil {
				r.stopErr = fmt.Errorf("registrytest: serve exited on SIGTERM: %w", r.waitErr)
			}
		case <-time.After(stopGrace):
			r.stopErr = errors.Join(fmt.Errorf("registrytest: serve did not exit within %v of SIGTERM; killed", stopGrace), r.kill())
		}
	})
	return r.stopErr
}

// Kill stops the registry with SIGKILL, as if its machine failed: no
// drain, and the embedded store recovers what it synced on the next
// start in the same DataDir (WithDataDir). It is safe to call more than
// once, and Stop after it does nothing.
func (r *Registry) Kill() error {
	var err error
	r.stopOnce.Do(func() { err = r.kill() })
	return err
}

func (r *Registry) kill() error {
	select {
	case <-r.exited:
		return nil
	default:
	}
	if err := r.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	<-r.exited
	return nil
}

// Close stops the registry, closes Conn and removes the store's temporary
// directory. It is safe to call more than once.
func (r *Registry) Close() error {
	r.closed.Do(func() {
		r.closeErr = errors.Join(r.Stop(), r.Conn.Close())
		r.removeTemp()
	})
	return r.closeErr
}

// Output is the registry's last lines of output (at most 200), for a
// test's failure message.
func (r *Registry) Output() string { return r.out.String() }

func (r *Registry) removeTemp() {
	if r.tempDir != "" {
		_ = os.RemoveAll(r.tempDir)
	}
}

// childEnv is the test's environment without IDEMREG_* variables: serve
// reads its flags from them, and a developer's IDEMREG_DATABASE_URL must
// not point a test's registry at a real database.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMREG_") {
			env = append(env, kv)
		}
	}
	return env
}

// read forwards serve's stderr to the logger, keeps its tail, and sends
// the address of the "serving" line. It reads to the end, so serve never
// stalls on a full pipe.
func (r *Registry) read(stderr io.Reader, logger *slog.Logger, listening chan<- string) {
	sc := bufio.NewScanner(stderr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	sent := false
	for sc.Scan() {
		text := sc.Text()
		r.out.add(text)
		var line map[string]any
		if json.Unmarshal([]byte(text), &line) != nil {
			logger.Error("idemreg output", "line", text)
			continue
		}
		msg, _ := line["msg"].(string)
		if !sent && msg == "serving" {
			if addr, ok := line["listen"].(string); ok {
				listening <- addr
				sent = true
			}
		}
		forward(logger, line)
	}
	_, _ = io.Copy(io.Discard, stderr)
}

func forward(logger *slog.Logger, line map[string]any) {
	var level slog.Level
	if s, ok := line["level"].(string); ok {
		_ = level.UnmarshalText([]byte(s))
	}
	msg, _ := line["msg"].(string)
	attrs := make([]any, 0, 2*len(line))
	for k, v := range line {
		if k != "time" && k != "level" && k != "msg" {
			attrs = append(attrs, k, v)
		}
	}
	logger.Log(context.Background(), level, msg, attrs...)
}

// waitServing waits until the registry's gRPC health says SERVING.
func waitServing(ctx context.Context, conn *grpc.ClientConn, exited <-chan struct{}) error {
	health := healthpb.NewHealthClient(conn)
	var last error
	for {
		callCtx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := health.Check(callCtx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		last = err
		if err == nil {
			last = fmt.Errorf("health: %v", resp.GetStatus())
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not serving: %w", last)
		case <-exited:
			return fmt.Errorf("serve exited while starting (last health check: %v)", last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// tail is the last lines of serve's output.
type tail struct {
	mu    sync.Mutex
	lines []string
}

const tailLines = 200

func (t *tail) add(line string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.lines) == tailLines {
		t.lines = append(t.lines[:0], t.lines[1:]...)
	}
	t.lines = append(t.lines, line)
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}
