package main

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBinaryDependencies fails when the production binary's import graph
// (this package without its tests, built as `make build` builds it) takes
// in a module that belongs to a tool beside it. Each entry says where the
// code that needs the module lives instead.
func TestBinaryDependencies(t *testing.T) {
	forbidden := []struct{ module, why string }{
		{"github.com/redis/go-redis", "the redis baseline's client: the load generator is cmd/idemreg-bench"},
		{"github.com/anishathalye/porcupine", "the linearizability checker: tests/lincheck, in the tests module"},
		{"github.com/Shopify/toxiproxy", "the network faults of the linearizability runs: tests/faults, in the tests module"},
		{"github.com/nats-io/nats.go", "the NATS client of the ledger example and its chaos run: examples/ledger, tests/faults"},
	}
	cmd := exec.CommandContext(t.Context(), "go", "list", "-deps",
		"-f", `{{if not .Standard}}{{.ImportPath}} {{join .Imports " "}}{{end}}`, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		t.Fatalf("go list: %v\n%s", err, exit.Stderr)
	}
	require.NoError(t, err)
	in := func(pkg, module string) bool { return pkg == module || strings.HasPrefix(pkg, module+"/") }
	listed := 0
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		listed++
		importer, imports := f[0], f[1:]
		for _, m := range forbidden {
			if in(importer, m.module) {
				continue // its own packages: the importer from outside is the news
			}
			for _, p := range imports {
				if in(p, m.module) {
					t.Errorf("cmd/idemreg links %s (%s): %s imports %s", m.module, m.why, importer, p)
				}
			}
		}
	}
	require.Greater(t, listed, 1, "go list listed the binary's packages")
}
