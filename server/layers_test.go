package server_test

import (
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLayers keeps the module's layers (docs/design.md, "Layers"): what
// runs below the request path never imports it, and the bottom imports
// nothing above it. Each rule names the packages it holds (by import path
// prefix) and the ones they must not import (a path, or with a final "/"
// everything under it); the go command lists the
// imports of every package of the module, tests left out.
func TestLayers(t *testing.T) {
	const mod = "github.com/idemreg/idemreg/"
	rules := []struct {
		what, below string
		mayNot      []string
		why         string
	}{
		{"server's mechanisms", mod + "server/internal/", []string{mod + "server", mod + "cmd/"},
			"they run below the handlers: the request path calls them, never the other way"},
		{"server's config packages", mod + "server/access", []string{mod + "server", mod + "cmd/"}, "the binary and the server read them"},
		{"server's config packages", mod + "server/policy", []string{mod + "server", mod + "cmd/"}, "the binary and the server read them"},
		{"server's config packages", mod + "server/configfile", []string{mod + "server", mod + "cmd/"}, "the binary and the server read them"},
		{"server's config packages", mod + "server/resulttype", []string{mod + "server", mod + "cmd/"}, "the binary, the console and the server read them"},
		{"the stores", mod + "storage", []string{mod + "server", mod + "server/", mod + "cmd/", mod + "retention", mod + "client"},
			"storage is the bottom: everything stands on it"},
		{"the sweeper", mod + "retention", []string{mod + "server", mod + "server/", mod + "cmd/"}, "it drives storage.Sweeper only"},
		{"the server", mod + "server", []string{mod + "cmd/", mod + "client"}, "the binary wires the server, and the client is a service's"},
	}
	cmd := exec.CommandContext(t.Context(), "go", "list", "-f", `{{.ImportPath}} {{join .Imports " "}}`, "../...")
	out, err := cmd.Output()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		t.Fatalf("go list: %v\n%s", err, exit.Stderr)
	}
	require.NoError(t, err)
	under := func(pkg, prefix string) bool {
		return pkg == prefix || strings.HasPrefix(pkg, strings.TrimSuffix(prefix, "/")+"/")
	}
	checked := 0
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		pkg, imports := f[0], f[1:]
		for _, r := range rules {
			if !under(pkg, r.below) {
				continue
			}
			checked++
			for _, imp := range imports {
				for _, no := range r.mayNot {
					// "server" forbids the package server itself and what
					// is beside it on the request path, not the package
					// that holds the rule.
					bad := imp == strings.TrimSuffix(no, "/") || strings.HasSuffix(no, "/") && strings.HasPrefix(imp, no)
					if bad && !under(imp, r.below) {
						t.Errorf("%s imports %s: %s (%s) may not import %s", pkg, imp, r.what, r.why, no)
					}
				}
			}
		}
	}
	require.Greater(t, checked, 10, "go list listed the module's packages")
}
