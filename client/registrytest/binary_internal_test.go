package registrytest

import (
	"archive/zip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

func TestCheckoutRoot(t *testing.T) {
	root, ok := checkoutRoot(sourceFile())
	if !ok {
		t.Fatalf("%s: not seen as inside the idemreg checkout", sourceFile())
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "idemreg", "main.go")); err != nil {
		t.Fatal(err)
	}
	for _, file := range []string{
		"github.com/idemreg/idemreg/client/registrytest/binary.go", // -trimpath
		filepath.Join(t.TempDir(), "pkg", "mod", "github.com", "idemreg", "idemreg", "client", "registrytest@v0.1.0", "binary.go"),
	} {
		if root, ok := checkoutRoot(file); ok {
			t.Errorf("%s: taken for a checkout at %s", file, root)
		}
	}
}

// Test binaries that need the release binary at once install it once:
// the others wait on the lock and find it. The module comes from a
// file:// proxy this test writes, so the go command's install path runs
// for real without the network; a wrapper counts the go commands.
func TestInstallOnceUnderConcurrency(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("the counting wrapper is a shell script")
	}
	proxy := t.TempDir()
	writeModule(t, proxy, "example.com/fakeidemreg", "v0.1.0", map[string]string{
		"go.mod":              "module example.com/fakeidemreg\n\ngo 1.22\n",
		"cmd/idemreg/main.go": "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"fake idemreg\") }\n",
	})
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatal(err)
	}
	count := filepath.Join(t.TempDir(), "count")
	wrapper := filepath.Join(t.TempDir(), "go")
	if err := os.WriteFile(wrapper, []byte("#!/bin/sh\necho \"$@\" >>"+count+"\nexec "+goBin+" \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	cacheRoot = func() (string, error) { return cache, nil }
	goCommand = wrapper
	t.Cleanup(func() { cacheRoot, goCommand = os.UserCacheDir, "go" })
	t.Setenv("GOPROXY", "file://"+proxy)
	t.Setenv("GONOSUMDB", "example.com")
	t.Setenv("GOFLAGS", "")
	t.Setenv("GOWORK", "off")
	t.Setenv("GOMODCACHE", t.TempDir())
	t.Setenv("GOTOOLCHAIN", "local")

	var wg sync.WaitGroup
	bins := make([]string, 4)
	errs := make([]error, 4)
	for i := range bins {
		wg.Go(func() { bins[i], errs[i] = install("example.com/fakeidemreg/cmd/idemreg", "v0.1.0") })
	}
	wg.Wait()
	for i := range bins {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if want := filepath.Join(cache, "idemreg", "v0.1.0", "idemreg"); bins[i] != want {
			t.Fatalf("installed at %s, want %s", bins[i], want)
		}
	}
	out, err := exec.Command(bins[0]).Output()
	if err != nil || string(out) != "fake idemreg\n" {
		t.Fatalf("the installed binary: %q, %v", out, err)
	}
	runs, _ := os.ReadFile(count)
	if lines := strings.Count(string(runs), "\n"); lines != 1 || !strings.HasPrefix(string(runs), "install example.com/fakeidemreg/cmd/idemreg@v0.1.0") {
		t.Fatalf("go ran %d times (want one install):\n%s", lines, runs)
	}
	// A test binary that starts later finds it without the go command.
	if _, err := install("example.com/fakeidemreg/cmd/idemreg", "v0.1.0"); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(count); string(again) != string(runs) {
		t.Fatalf("a later install ran go again:\n%s", again)
	}
}

// writeModule lays out module@version in a GOPROXY directory.
func writeModule(t *testing.T, proxy, module, version string, files map[string]string) {
	t.Helper()
	dir := filepath.Join(proxy, filepath.FromSlash(module), "@v")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("list", version+"\n")
	write(version+".info", `{"Version":"`+version+`","Time":"2026-01-01T00:00:00Z"}`)
	write(version+".mod", files["go.mod"])
	f, err := os.Create(filepath.Join(dir, version+".zip"))
	if err != nil {
		t.Fatal(err)
	}
	zw := zip.NewWriter(f)
	for name, data := range files {
		w, err := zw.Create(module + "@" + version + "/" + name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write([]byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
