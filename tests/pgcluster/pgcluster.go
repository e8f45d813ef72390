// Package pgcluster runs a PostgreSQL cluster that one test owns: created
// with initdb in a temporary directory, served on its own loopback port,
// and stopped (abruptly if the test wants) and started again by the test.
// Fault tests use it so that they never touch the machine's shared cluster.
package pgcluster

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// BinDirEnv names the environment variable that points at the directory of
// initdb and pg_ctl; by default the newest /usr/lib/postgresql/*/bin.
const BinDirEnv = "IDEMREG_TEST_PG_BIN"

// Cluster is a PostgreSQL cluster owned by a test.
type Cluster struct {
	bin, dir, port string
	// runAs is the user that runs the server when the test runs as root,
	// which initdb and postgres refuse.
	runAs string
}

// Start creates a cluster in a new temporary directory, starts it on a free
// loopback port with trust authentication, and stops it and removes the
// directory when the test ends. It skips the test when no PostgreSQL
// binaries are found.
func Start(t testing.TB) *Cluster {
	t.Helper()
	bin := os.Getenv(BinDirEnv)
	if bin == "" {
		dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
		if len(dirs) > 0 {
			bin = dirs[len(dirs)-1]
		}
	}
	if _, err := os.Stat(filepath.Join(bin, "initdb")); err != nil {
		t.Skipf("pgcluster: no initdb (set %s to PostgreSQL's bin directory)", BinDirEnv)
	}
	c := &Cluster{bin: bin}
	if os.Geteuid() == 0 {
		c.runAs = "postgres"
	}
	// Not t.TempDir: the server's user must be able to reach it.
	dir, err := os.MkdirTemp("", "idemreg-pgcluster-")
	if err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	c.dir = dir
	t.Cleanup(func() {
		_ = c.pgctl("stop", "-m", "immediate")
		_ = os.RemoveAll(dir)
	})
	if c.runAs != "" {
		u, err := user.Lookup(c.runAs)
		if err != nil {
			t.Skipf("pgcluster: running as root and there is no %q user to run PostgreSQL", c.runAs)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatalf("pgcluster: %v", err)
		}
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	_, c.port, _ = net.SplitHostPort(lis.Addr().String())
	_ = lis.Close()

	if out, err := c.command("initdb", "-D", c.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8",
		"--no-sync", "--no-instructions").CombinedOutput(); err != nil {
		t.Fatalf("pgcluster: initdb: %v\n%s", err, out)
	}
	if err := c.Start(); err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	return c
}

func (c *Cluster) data() string { return filepath.Join(c.dir, "data") }

// Addr is the cluster's host:port.
func (c *Cluster) Addr() string { return "127.0.0.1:" + c.port }

// URL is the URL of database db on the cluster through addr (the cluster's
// own Addr, or a proxy in front of it).
func (c *Cluster) URL(addr, db string) string {
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", addr, db)
}

// Start starts the server and waits until it accepts connections (after a
// crash, that includes its recovery).
func (c *Cluster) Start() error {
	return c.pgctl("start", "-w", "-t", "60", "-l", filepath.Join(c.dir, "server.log"),
		"-o", fmt.Sprintf("-p %s -k %s -c listen_addresses=127.0.0.1 -c max_connections=200", c.port, c.dir))
}

// StopImmediate stops the server the way a crash does (pg_ctl stop -m
// immediate: no checkpoint, connections dropped); the next Start recovers
// from the WAL.
func (c *Cluster) StopImmediate() error { return c.pgctl("stop", "-m", "immediate", "-w") }

// Log returns the server's log, for a failing test.
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.dir, "server.log"))
	return string(b)
}

func (c *Cluster) pgctl(args ...string) error {
	out, err := c.command("pg_ctl", append([]string{"-D", c.data()}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("pg_ctl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (c *Cluster) command(name string, args ...string) *exec.Cmd {
	path := filepath.Join(c.bin, name)
	if c.runAs == "" {
		return exec.Command(path, args...)
	}
	return exec.Command("runuser", append([]string{"-u", c.runAs, "--", path}, args...)...)
}
