package registrytest

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
)

// Version is the release of the registry Binary installs when it finds
// no other binary: the idemreg release this package was tagged with.
const Version = "v0.1.0"

// Where Binary installs; variables for this package's tests.
var (
	installVersion = Version
	installModule  = "github.com/idemreg/idemreg/cmd/idemreg"
	cacheRoot      = os.UserCacheDir
	sourceFile     = func() string { _, file, _, _ := runtime.Caller(0); return file }
	goCommand      = "go"
)

var found struct {
	once sync.Once
	bin  string
	err  error
}

// Binary returns the idemreg binary New runs, looked up once per process,
// the first of:
//
//  1. $IDEMREG_BIN, which must name an executable;
//  2. inside the idemreg repository (this package's source in a checkout
//     of it, as a replace directive or a go.work places it), a binary
//     built from that checkout's ./cmd/idemreg, so that the repository's
//     tests run the code they test; it is built once per test binary;
//  3. idemreg on PATH;
//  4. `go install github.com/idemreg/idemreg/cmd/idemreg@Version` into
//     os.UserCacheDir()/idemreg/<Version>, once per machine: a lock file
//     there keeps parallel test binaries from building it twice.
//
// Steps 2 and 4 need the go command; the first build of the registry
// takes a minute or more.
func Binary() (string, error) {
	found.once.Do(func() { found.bin, found.err = findBinary() })
	return found.bin, found.err
}

func findBinary() (string, error) {
	if bin := os.Getenv("IDEMREG_BIN"); bin != "" {
		if err := executable(bin); err != nil {
			return "", fmt.Errorf("registrytest: IDEMREG_BIN: %w", err)
		}
		return bin, nil
	}
	if root, ok := checkoutRoot(sourceFile()); ok {
		return buildCheckout(root)
	}
	if bin, err := exec.LookPath("idemreg"); err == nil {
		return bin, nil
	}
	return install(installModule, installVersion)
}

func executable(path string) error {
	fi, err := os.Stat(path)
	switch {
	case err != nil:
		return err
	case fi.IsDir() || fi.Mode()&0o111 == 0 && runtime.GOOS != "windows":
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}

// checkoutRoot is the root of the idemreg repository that holds file
// (this package's source), if it is one: in the module cache, or built
// with -trimpath, it is not.
func checkoutRoot(file string) (string, bool) {
	if !filepath.IsAbs(file) {
		return "", false
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	mod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil || !bytes.HasPrefix(mod, []byte("module github.com/idemreg/idemreg\n")) {
		return "", false
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "idemreg", "main.go")); err != nil {
		return "", false
	}
	return filepath.Clean(root), true
}

// buildCheckout builds root's ./cmd/idemreg into the cache directory, one
// file per checkout, once per test binary. Builds take the lock in turn
// (the go command's cache makes the second one a link) and rename the new
// binary over the old one, so a registry another test binary runs from
// it keeps its file.
func buildCheckout(root string) (string, error) {
	h := fnv.New64a()
	h.Write([]byte(root))
	dir, err := cacheDir(fmt.Sprintf("checkout-%x", h.Sum64()))
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, exe("idemreg"))
	err = withLock(filepath.Join(dir, "lock"), func() error {
		tmp, err := os.MkdirTemp(dir, "build-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		cmd := exec.Command(goCommand, "build", "-o", filepath.Join(tmp, exe("idemreg")), "./cmd/idemreg")
		cmd.Dir = root
		cmd.Env = withoutGOWORK(os.Environ())
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build ./cmd/idemreg in %s: %w\n%s", root, err, out)
		}
		return os.Rename(filepath.Join(tmp, exe("idemreg")), bin)
	})
	if err != nil {
		return "", fmt.Errorf("registrytest: %w", err)
	}
	return bin, nil
}

// install runs `go install module@version` with GOBIN in the cache
// directory of the version, unless an earlier run did.
func install(module, version string) (string, error) {
	dir, err := cacheDir(version)
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, exe(filepath.Base(module)))
	err = withLock(filepath.Join(dir, "lock"), func() error {
		if executable(bin) == nil {
			return nil // another test binary installed it while this one waited
		}
		cmd := exec.Command(goCommand, "install", module+"@"+version)
		cmd.Dir = dir // outside any module: go install pkg@version ignores it anyway
		cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go install %s@%s: %w\n%s", module, version, err, out)
		}
		return executable(bin)
	})
	if err != nil {
		return "", fmt.Errorf("registrytest: %w (or set IDEMREG_BIN to an idemreg binary)", err)
	}
	return bin, nil
}

func cacheDir(name string) (string, error) {
	root, err := cacheRoot()
	if err != nil {
		return "", fmt.Errorf("registrytest: no cache directory for the idemreg binary (set IDEMREG_BIN): %w", err)
	}
	dir := filepath.Join(root, "idemreg", name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("registrytest: %w", err)
	}
	return dir, nil
}

// withLock runs f holding an exclusive lock on the file path.
func withLock(path string, f func() error) error {
	unlock, err := lockFile(path)
	if err != nil {
		return fmt.Errorf("lock %s: %w", path, err)
	}
	return errors.Join(f(), unlock())
}

func exe(name string) string {
	if runtime.GOOS == "windows" {
		return name + ".exe"
	}
	return name
}

// withoutGOWORK drops GOWORK from env, so that the go command in the
// checkout uses the checkout's own go.work (or none), not a workspace the
// test binary's environment names for the module under test.
func withoutGOWORK(env []string) []string {
	var out []string
	for _, kv := range env {
		if !strings.HasPrefix(kv, "GOWORK=") {
			out = append(out, kv)
		}
	}
	return out
}
