package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// writeFiles writes name -> content under dir.
func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// A repository of two modules, the root requiring the other at v0.1.0,
// which no proxy knows: the proxy built from the tree serves both, and a
// fresh module outside resolves, builds and vets through it alone.
func TestProxyServesTheTree(t *testing.T) {
	repo := t.TempDir()
	writeFiles(t, repo, map[string]string{
		"go.mod":           "module example.com/tree\n\ngo 1.24.0\n\nrequire example.com/tree/lib v0.1.0\n",
		"tree.go":          "package tree\n\nimport \"example.com/tree/lib\"\n\nfunc Answer() int { return lib.Answer }\n",
		"lib/go.mod":       "module example.com/tree/lib\n\ngo 1.24.0\n",
		"lib/lib.go":       "package lib\n\nconst Answer = 42\n",
		"lib/untracked.go": "package lib\n\n// Later is not committed yet: the tree is served, not the commit.\nconst Later = 1\n",
		".gitignore":       "ignored.go\n",
		"ignored.go":       "package tree\n\nthis does not compile\n",
	})
	run(t, repo, nil, "git", "init", "-q")
	run(t, repo, nil, "git", "add", "go.mod", "tree.go", "lib/go.mod", "lib/lib.go", ".gitignore")

	out := filepath.Join(t.TempDir(), "proxy")
	mods, err := buildProxy(repo, out, "", []string{".", "lib"})
	if err != nil {
		t.Fatal(err)
	}
	if len(mods) != 2 || mods[0].Version.Version != "v0.1.0" {
		t.Fatalf("served %v, want both modules at v0.1.0", mods)
	}
	for _, f := range []string{"example.com/tree/@v/list", "example.com/tree/@v/v0.1.0.info", "example.com/tree/@v/v0.1.0.mod",
		"example.com/tree/@v/v0.1.0.zip", "example.com/tree/lib/@v/v0.1.0.zip"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("the proxy lacks %s: %v", f, err)
		}
	}

	user := t.TempDir()
	writeFiles(t, user, map[string]string{
		"go.mod":  "module example.com/user\n\ngo 1.24.0\n",
		"main.go": "package main\n\nimport (\n\t\"fmt\"\n\n\t\"example.com/tree\"\n\t\"example.com/tree/lib\"\n)\n\nfunc main() { fmt.Println(tree.Answer(), lib.Later) }\n",
	})
	env := []string{"GOWORK=off", "GOFLAGS=-mod=mod -modcacherw", "GOPROXY=file://" + out, "GONOSUMDB=example.com",
		"GOMODCACHE=" + filepath.Join(t.TempDir(), "modcache")}
	run(t, user, env, "go", "get", "example.com/tree@v0.1.0")
	run(t, user, env, "go", "vet", ".")
	if got := run(t, user, env, "go", "list", "-m", "-f", "{{.Version}}", "example.com/tree/lib"); strings.TrimSpace(got) != "v0.1.0" {
		t.Errorf("example.com/tree/lib at %q, want v0.1.0", got)
	}
}

func TestProxyRefuses(t *testing.T) {
	for _, tc := range []struct {
		name     string
		files    map[string]string
		released []string
		want     string
	}{
		{
			name: "two versions required",
			files: map[string]string{
				"go.mod":     "module example.com/tree\n\ngo 1.24.0\n\nrequire example.com/tree/lib v0.1.0\n",
				"lib/go.mod": "module example.com/tree/lib\n\ngo 1.24.0\n\nrequire example.com/tree v0.2.0\n",
			},
			want: "do not require our modules at one version",
		},
		{
			name: "a replace in a released module",
			files: map[string]string{
				"go.mod":     "module example.com/tree\n\ngo 1.24.0\n\nrequire example.com/tree/lib v0.1.0\n\nreplace example.com/tree/lib => ./lib\n",
				"lib/go.mod": "module example.com/tree/lib\n\ngo 1.24.0\n",
			},
			released: []string{"."},
			want:     "replace or exclude",
		},
		{
			name: "a pseudo-version",
			files: map[string]string{
				"go.mod":     "module example.com/tree\n\ngo 1.24.0\n\nrequire example.com/tree/lib v0.0.0-00010101000000-000000000000\n",
				"lib/go.mod": "module example.com/tree/lib\n\ngo 1.24.0\n",
			},
			want: "not a pseudo-version",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			repo := t.TempDir()
			writeFiles(t, repo, tc.files)
			run(t, repo, nil, "git", "init", "-q")
			_, err := buildProxy(repo, filepath.Join(t.TempDir(), "proxy"), "", tc.released)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one saying %q", err, tc.want)
			}
		})
	}
}

func TestVulnDB(t *testing.T) {
	osv := t.TempDir()
	writeFiles(t, osv, map[string]string{
		// Fixed twice; the index names the latest fix.
		"GO-2026-0001.json": `{"id":"GO-2026-0001","modified":"2026-01-02T00:00:00Z","affected":[{"package":{"name":"example.com/a","ecosystem":"Go"},
			"ranges":[{"type":"SEMVER","events":[{"introduced":"0"},{"fixed":"1.2.3"},{"introduced":"1.3.0"},{"fixed":"1.3.1"}]}]}]}`,
		// Introduced again after its last fix: no fix to name.
		"GO-2026-0002.json": `{"id":"GO-2026-0002","modified":"2026-03-04T00:00:00Z","affected":[{"package":{"name":"example.com/a","ecosystem":"Go"},
			"ranges":[{"type":"SEMVER","events":[{"introduced":"0"},{"fixed":"1.0.0"},{"introduced":"1.1.0"}]}]}]}`,
	})
	out := filepath.Join(t.TempDir(), "db")
	n, err := buildVulnDB(osv, out)
	if err != nil || n != 2 {
		t.Fatalf("buildVulnDB = %d, %v", n, err)
	}
	var mods []moduleMeta
	raw, err := os.ReadFile(filepath.Join(out, "index", "modules.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &mods); err != nil {
		t.Fatal(err)
	}
	if len(mods) != 1 || len(mods[0].Vulns) != 2 || mods[0].Vulns[0].Fixed != "1.3.1" || mods[0].Vulns[1].Fixed != "" {
		t.Fatalf("modules.json = %s", raw)
	}
	var db dbMeta
	raw, _ = os.ReadFile(filepath.Join(out, "index", "db.json"))
	if err := json.Unmarshal(raw, &db); err != nil || db.Modified.Month() != 3 {
		t.Fatalf("db.json = %s (%v): want the latest entry's time", raw, err)
	}
	if _, err := os.Stat(filepath.Join(out, "ID", "GO-2026-0002.json")); err != nil {
		t.Fatal(err)
	}

	writeFiles(t, osv, map[string]string{"GO-2026-0003.json": `{"id":"GO-2026-0009"}`})
	if _, err := buildVulnDB(osv, out); err == nil {
		t.Fatal("an entry whose file is not named after its id was accepted")
	}
}

func TestVulnReport(t *testing.T) {
	stream := `{"config":{"protocol_version":"v1.0.0"}}
{"finding":{"osv":"GO-2026-0001","fixed_version":"v1.26.9","trace":[{"module":"stdlib","version":"v1.26.8","package":"net/http","function":"Get"}]}}
`
	var out bytes.Buffer
	if err := vulnReport(strings.NewReader(stream), &out); err != nil {
		t.Fatalf("a standard library finding failed the report: %v\n%s", err, &out)
	}
	stream += `{"finding":{"osv":"GO-2026-0002","fixed_version":"v0.62.0","trace":[{"module":"golang.org/x/net","version":"v0.58.0"}]}}
{"finding":{"osv":"GO-2026-0002","fixed_version":"v0.62.0","trace":[{"module":"golang.org/x/net","version":"v0.58.0","package":"golang.org/x/net/html"}]}}
`
	out.Reset()
	err := vulnReport(strings.NewReader(stream), &out)
	if err == nil || !strings.Contains(out.String(), "FAIL: GO-2026-0002 in golang.org/x/net@v0.58.0, fixed in v0.62.0: package") {
		t.Fatalf("err = %v, output:\n%s", err, &out)
	}
}
