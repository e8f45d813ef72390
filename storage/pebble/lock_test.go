package pebble

import (
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	envLockDir  = "IDEMREG_PEBBLE_TEST_LOCK_DIR"
	envCrashDir = "IDEMREG_PEBBLE_TEST_CRASH_DIR"
)

func TestLockSameProcess(t *testing.T) {
	dir := t.TempDir()
	openT(t, dir)
	_, err := Open(dir+"/./", WithLogger(testLogger(t)))
	require.ErrorIs(t, err, ErrLocked)
	require.Contains(t, err.Error(), dir)
	require.Contains(t, err.Error(), "another idemreg")
}

// TestLockChild is the second process of TestLockSecondProcess.
func TestLockChild(t *testing.T) {
	dir := os.Getenv(envLockDir)
	if dir == "" {
		t.Skip("runs as the child of TestLockSecondProcess")
	}
	s, err := Open(dir, WithLogger(testLogger(t)))
	fmt.Printf("open error: %v\n", err)
	if err == nil {
		require.NoError(t, s.Close())
	}
}

func TestLockSecondProcess(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)

	child := func() (string, error) {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestLockChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), envLockDir+"="+dir)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := child()
	require.NoError(t, err, out)
	require.Contains(t, out, "open error: pebble: data directory is locked: "+dir)

	require.NoError(t, s.Close())
	out, err = child()
	require.NoError(t, err, out)
	require.Contains(t, out, "open error: <nil>", "the child opens the directory once it is released")
}
