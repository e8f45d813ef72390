package server_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDocMap keeps the two maps a newcomer reads first from drifting
// (issue 38): server/doc.go names every file of package server and every
// package below server/, and docs/design.md's "Packages" table names every
// package of the module. A file or package added, renamed or removed
// without its map fails here, whichever way the two disagree.
func TestDocMap(t *testing.T) {
	t.Run("server/doc.go", func(t *testing.T) {
		src, err := os.ReadFile("doc.go")
		require.NoError(t, err)
		doc := string(src)

		entries, err := os.ReadDir(".")
		require.NoError(t, err)
		var files []string
		for _, e := range entries {
			name := e.Name()
			if !e.IsDir() && strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go") && name != "doc.go" {
				files = append(files, name)
				if !regexp.MustCompile(`(^|[^\w/.])` + regexp.QuoteMeta(name) + `\b`).MatchString(doc) {
					t.Errorf("server/%s is not in server/doc.go's map: say which step of the request path it is", name)
				}
			}
		}
		require.Greater(t, len(files), 10, "the package's files were listed")

		// Every package below server/ (the mechanisms of server/internal
		// and the config packages beside the request path).
		var pkgs []string
		require.NoError(t, filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() || path == "." {
				return err
			}
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if goFiles, _ := filepath.Glob(filepath.Join(path, "*.go")); slices.ContainsFunc(goFiles, func(f string) bool {
				return !strings.HasSuffix(f, "_test.go")
			}) {
				pkgs = append(pkgs, "server/"+filepath.ToSlash(path))
			}
			return nil
		}))
		for _, p := range pkgs {
			if !regexp.MustCompile(regexp.QuoteMeta(p) + `\b`).MatchString(doc) {
				t.Errorf("%s is not in server/doc.go's map", p)
			}
		}
		require.Contains(t, pkgs, "server/internal/quota", "the packages below server/ were listed")

		// And nothing the map names is gone: a bare file name is one of
		// this package's, a server/... path one of its packages.
		for _, m := range regexp.MustCompile(`(?:^|[^\w/.])(\w+\.go)\b`).FindAllStringSubmatch(doc, -1) {
			if !slices.Contains(files, m[1]) {
				t.Errorf("server/doc.go names %s, which package server no longer has", m[1])
			}
		}
		for _, m := range regexp.MustCompile(`\bserver/[a-z/]+[a-z]`).FindAllString(doc, -1) {
			if fi, err := os.Stat(strings.TrimPrefix(m, "server/")); err != nil || !fi.IsDir() {
				t.Errorf("server/doc.go names %s, which is not a directory of server/", m)
			}
		}
	})

	t.Run("docs/design.md", func(t *testing.T) {
		src, err := os.ReadFile("../docs/design.md")
		require.NoError(t, err)
		_, table, ok := strings.Cut(string(src), "\n### Packages\n")
		require.True(t, ok, `docs/design.md has no "### Packages" section`)
		table, _, _ = strings.Cut(table, "\n#")
		row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")
		named := map[string]bool{}
		for _, m := range row.FindAllStringSubmatch(table, -1) {
			named[m[1]] = true
		}

		const mod = "github.com/idemreg/idemreg"
		cmd := exec.CommandContext(t.Context(), "go", "list", "-f", `{{if .GoFiles}}{{.ImportPath}}{{end}}`, "../...")
		out, err := cmd.Output()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			t.Fatalf("go list: %v\n%s", err, exit.Stderr)
		}
		require.NoError(t, err)
		listed := map[string]bool{}
		for line := range strings.Lines(string(out)) {
			pkg := strings.TrimPrefix(strings.TrimSpace(line), mod+"/")
			if pkg == "" {
				continue
			}
			listed[pkg] = true
			if !named[pkg] {
				t.Errorf("%s is not in docs/design.md's package table (\"Packages\"): add a row saying what it owns", pkg)
			}
		}
		require.Greater(t, len(listed), 20, "go list listed the module's packages")
		for pkg := range named {
			if !listed[pkg] {
				t.Errorf("docs/design.md's package table names %s, which the module does not have", pkg)
			}
		}
	})
}
