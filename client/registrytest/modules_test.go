package registrytest_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemreg/idemreg/client/registrytest"
)

// A service's module that imports registrytest takes its go.mod's
// requirements: they must be the client's and no more, at versions no
// higher than the client's (issue 39: it took the registry's 205
// modules, Go 1.26.8 and gRPC 1.85 before). And the packages a service's
// test links through it are the client's, the API's, gRPC's and the
// standard library's: not the registry's server or storage.
func TestModuleTakesOnlyTheClient(t *testing.T) {
	own := readGoMod(t, "go.mod")
	cl := readGoMod(t, filepath.Join("..", "go.mod"))
	if compareVersions(own.goLine, cl.goLine) > 0 {
		t.Errorf("go %s: above the client's go %s", own.goLine, cl.goLine)
	}
	for path, v := range own.require {
		switch {
		case path == "github.com/idemreg/idemreg/client":
		case strings.HasPrefix(path, "github.com/idemreg/"):
			if path != "github.com/idemreg/idemreg/proto" || v != cl.require[path] {
				t.Errorf("requires %s %s: of our modules only the client and the API at the client's version", path, v)
			}
		case cl.require[path] == "":
			t.Errorf("requires %s %s, which the client does not", path, v)
		case compareVersions(v, cl.require[path]) > 0:
			t.Errorf("requires %s %s, above the client's %s", path, v, cl.require[path])
		}
	}
	// Our modules are released together: the binary Binary installs is
	// the release of the client this module requires.
	if v := own.require["github.com/idemreg/idemreg/client"]; v != registrytest.Version {
		t.Errorf("requires the client %s, but Version (the idemreg binary installed) is %s", v, registrytest.Version)
	}
	if g := own.require["google.golang.org/grpc"]; g == "" || g != cl.require["google.golang.org/grpc"] {
		t.Errorf("gRPC %q: want the client's floor %s", g, cl.require["google.golang.org/grpc"])
	}

	out, err := exec.Command("go", "list", "-deps", "-test", "-f", "{{with .Module}}{{.Path}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	allowed := map[string]bool{
		"github.com/idemreg/idemreg/client/registrytest": true,
		"github.com/idemreg/idemreg/client":              true,
		"github.com/idemreg/idemreg/proto":               true,
	}
	for path := range cl.require {
		allowed[path] = true
	}
	for _, m := range strings.Fields(string(out)) {
		if !allowed[m] {
			t.Errorf("links a package of %s, a module the client does not require", m)
		}
	}
}

type goMod struct {
	goLine  string
	require map[string]string
}

var requireLine = regexp.MustCompile(`^\s*(?:require\s+)?([\w./-]+)\s+(v[^\s]+)(\s*//.*)?$`)

// readGoMod reads a go.mod's go line and requirements (direct and
// indirect), enough for the checks above without golang.org/x/mod.
func readGoMod(t *testing.T, path string) goMod {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := goMod{require: map[string]string{}}
	inRequire := false
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "go "):
			m.goLine = strings.TrimPrefix(line, "go ")
		case line == "require (":
			inRequire = true
		case line == ")":
			inRequire = false
		case inRequire || strings.HasPrefix(line, "require "):
			if s := requireLine.FindStringSubmatch(line); s != nil {
				m.require[s[1]] = s[2]
			}
		}
	}
	if m.goLine == "" {
		t.Fatalf("%s: no go line", path)
	}
	return m
}

// compareVersions compares dotted versions (1.24.0, v1.64.1) by their
// leading numbers; a pseudo-version's date part compares as text.
func compareVersions(a, b string) int {
	as := strings.Split(strings.TrimPrefix(a, "v"), ".")
	bs := strings.Split(strings.TrimPrefix(b, "v"), ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y string
		if i < len(as) {
			x = as[i]
		}
		if i < len(bs) {
			y = bs[i]
		}
		if len(x) != len(y) {
			if len(x) < len(y) {
				return -1
			}
			return 1
		}
		if c := strings.Compare(x, y); c != 0 {
			return c
		}
	}
	return 0
}
