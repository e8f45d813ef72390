package watermill_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
)

// registryAddr is the address of the `idemreg serve` the tests share: a
// real registry on the embedded store, started by TestMain from the
// binary IDEMREG_BIN names or, without it, from one built from this
// checkout. Keys are unique per test (consumer names carry the test's
// name), so the tests do not see each other's records.
var registryAddr string

func TestMain(m *testing.M) {
	if os.Getenv(subscriberEnv) != "" {
		os.Exit(runSubscriber())
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "idemreg-watermill-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	bin := os.Getenv("IDEMREG_BIN")
	if bin == "" {
		bin = filepath.Join(dir, "idemreg")
		build := exec.Command("go", "build", "-o", bin, "./cmd/idemreg")
		build.Dir = "../.."
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "building idemreg: %v\n%s", err, out)
			return 1
		}
	}
	addr, err := freeAddr()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	serve := exec.Command(bin, "serve", "--listen", addr, "--data-dir", filepath.Join(dir, "data"),
		"--min-lease", "100ms", "--log-level", "error")
	serve.Env = withoutIdemregEnv()
	serve.Stdout, serve.Stderr = os.Stderr, os.Stderr
	if err := serve.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() {
		_ = serve.Process.Kill()
		_ = serve.Wait()
	}()
	if err := waitReady(addr, 60*time.Second); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	registryAddr = addr
	return m.Run()
}

// withoutIdemregEnv is the environment without IDEMREG_* variables, which
// serve would read as flags.
func withoutIdemregEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if len(kv) < 8 || kv[:8] != "IDEMREG_" {
			env = append(env, kv)
		}
	}
	return env
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// waitReady waits for the port, then for an answer (NOT_FOUND is one), so
// that no test's connection starts in a reconnect backoff.
func waitReady(addr string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("idemreg serve did not listen on %s: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	c, conn, err := dial(addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Lookup(ctx, client.Key{Consumer: "ready", Kind: client.KindMessage, Key: "probe"})
		cancel()
		if err == nil || errors.Is(err, client.ErrNotFound) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("idemreg serve did not answer on %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func dial(addr string) (*client.Client, *grpc.ClientConn, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return client.New(conn), conn, nil
}

// newClient is a client of the shared registry, closed with the test.
func newClient(t *testing.T) *client.Client {
	t.Helper()
	c, conn, err := dial(registryAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return c
}
