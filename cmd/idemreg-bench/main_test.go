package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// binary is one command the tests run, built once per test process with
// -race: linking takes seconds, and several tests need each.
type binary struct {
	once sync.Once
	bin  string
	out  []byte
	err  error
}

var (
	// buildDir holds the built binaries; TestMain removes it.
	buildDir string
	// benchBinary is this command, for what needs it as a process of its
	// own (the grpc-floor target starts its server from it); serverBinary
	// is idemreg, for the server targets.
	benchBinary, serverBinary binary
)

func build(t *testing.T, b *binary, name, pkg string) string {
	t.Helper()
	b.once.Do(func() {
		b.bin = filepath.Join(buildDir, name)
		b.out, b.err = exec.Command("go", "build", "-race", "-o", b.bin, pkg).CombinedOutput()
	})
	require.NoError(t, b.err, "go build %s: %s", pkg, b.out)
	return b.bin
}

func benchBin(t *testing.T) string   { return build(t, &benchBinary, "idemreg-bench", ".") }
func idemregBin(t *testing.T) string { return build(t, &serverBinary, "idemreg", serverPackage) }

func TestMain(m *testing.M) {
	var err error
	if buildDir, err = os.MkdirTemp("", "idemreg-bench-test-"); err != nil {
		panic(err)
	}
	code := m.Run()
	_ = os.RemoveAll(buildDir)
	os.Exit(code)
}
