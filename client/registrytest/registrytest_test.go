package registrytest_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/registrytest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

func TestStartRunsTheRegistry(t *testing.T) {
	reg := registrytest.Start(t)
	ran := 0
	for range 2 {
		res, err := reg.Client.Once(t.Context(), "svc.test", "m-1", func(context.Context, client.Attempt) ([]byte, error) {
			ran++
			return []byte("done"), nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if string(res.Data) != "done" {
			t.Fatalf("data %q, want done", res.Data)
		}
	}
	if ran != 1 {
		t.Fatalf("the handler ran %d times, want 1", ran)
	}
	if !strings.HasPrefix(reg.Addr, "127.0.0.1:") || strings.HasSuffix(reg.Addr, ":0") {
		t.Fatalf("Addr %q: want the port serve bound on loopback", reg.Addr)
	}
}

// Stop is SIGTERM: serve drains and exits 0, and calls through Conn fail
// with UNAVAILABLE.
func TestStop(t *testing.T) {
	reg := registrytest.Start(t)
	if err := reg.Stop(); err != nil {
		t.Fatalf("Stop: %v\n%s", err, reg.Output())
	}
	if !strings.Contains(reg.Output(), `"msg":"stopped"`) {
		t.Fatalf("serve did not log that it stopped:\n%s", reg.Output())
	}
	_, err := reg.Client.Claim(t.Context(), client.ClaimParams{Key: client.Key{Consumer: "svc.test", Kind: client.KindOperation, Key: "m-1"}})
	var ue *client.UnavailableError
	if !errors.As(err, &ue) {
		t.Fatalf("Claim after Stop: %v, want a client.UnavailableError", err)
	}
	if err := reg.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
}

// A registry killed and started again on its DataDir replays what it
// had completed.
func TestKillAndRestartOnTheDataDir(t *testing.T) {
	dir := t.TempDir()
	first := registrytest.Start(t, registrytest.WithDataDir(dir))
	if _, err := first.Client.Once(t.Context(), "svc.test", "m-1", func(context.Context, client.Attempt) ([]byte, error) {
		return []byte("first"), nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := first.Kill(); err != nil {
		t.Fatal(err)
	}
	second := registrytest.Start(t, registrytest.WithDataDir(dir))
	res, err := second.Client.Once(t.Context(), "svc.test", "m-1", func(context.Context, client.Attempt) ([]byte, error) {
		t.Error("the handler ran again after the restart")
		return nil, nil
	})
	if err != nil || !res.Replayed || string(res.Data) != "first" {
		t.Fatalf("after restart: %+v, %v; want the replay of first", res, err)
	}
}

// WithLimits reaches serve's flags: a 20 ms lease is refused by default
// (below --min-lease 1s) and accepted with MinLease 10 ms.
func TestWithLimits(t *testing.T) {
	claim := func(reg *registrytest.Registry) error {
		_, err := idemregv1.NewRegistryServiceClient(reg.Conn).Claim(t.Context(), &idemregv1.ClaimRequest{
			Consumer: "svc.test", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k", Fingerprint: []byte("f"),
			Lease: durationpb.New(20 * time.Millisecond),
		})
		return err
	}
	if err := claim(registrytest.Start(t)); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a 20 ms lease with the default limits: %v, want INVALID_ARGUMENT", err)
	}
	l := registrytest.DefaultLimits()
	l.MinLease = 10 * time.Millisecond
	if err := claim(registrytest.Start(t, registrytest.WithLimits(l))); err != nil {
		t.Fatalf("a 20 ms lease with MinLease 10ms: %v", err)
	}
}

// WithArgs passes serve's flags through; a flag serve refuses makes New
// fail with serve's own message, not hang.
func TestWithArgs(t *testing.T) {
	_, err := registrytest.New(registrytest.WithArgs("--max-in-flight=-3"))
	if err == nil || !strings.Contains(err.Error(), "max-in-flight") {
		t.Fatalf("New with --max-in-flight=-3: %v, want serve's refusal naming the flag", err)
	}
}

func TestWithLogger(t *testing.T) {
	var buf syncBuffer
	registrytest.Start(t, registrytest.WithLogger(slog.New(slog.NewTextHandler(&buf, nil))))
	if !regexp.MustCompile(`level=INFO msg=serving .*listen=127\.0\.0\.1:\d+`).MatchString(buf.String()) {
		t.Fatalf("the logger did not get serve's serving line:\n%s", buf.String())
	}
}

// DefaultLimits is serve's defaults, as `idemreg serve -h` prints them.
func TestDefaultLimitsAreServes(t *testing.T) {
	bin, err := registrytest.Binary()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := exec.Command(bin, "serve", "-h").CombinedOutput()
	defaults := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z-]+) \w+\n\s+.*\(default ([^)]+)\)$`).FindAllSubmatch(out, -1) {
		defaults[string(m[1])] = string(m[2])
	}
	l := registrytest.DefaultLimits()
	for flag, want := range map[string]time.Duration{
		"default-lease": l.DefaultLease, "min-lease": l.MinLease, "max-lease": l.MaxLease,
		"max-lease-total": l.MaxLeaseTotal, "default-message-retention": l.DefaultMessageRetention,
		"default-operation-retention": l.DefaultOperationRetention, "min-retention": l.MinRetention,
		"max-retention": l.MaxRetention,
	} {
		if got := parseDuration(t, defaults[flag]); got != want {
			t.Errorf("--%s: serve's default %q, DefaultLimits %v", flag, defaults[flag], want)
		}
	}
	if got := defaults["max-result-bytes"]; got != strconv.Itoa(l.MaxResultBytes) {
		t.Errorf("--max-result-bytes: serve's default %q, DefaultLimits %d", got, l.MaxResultBytes)
	}
}

// parseDuration reads serve's -h durations, which count whole days in d.
func parseDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil {
			t.Fatalf("duration %q: %v", s, err)
		}
		return time.Duration(n) * 24 * time.Hour
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("duration %q: %v", s, err)
	}
	return d
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
