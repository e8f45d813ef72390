package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	"golang.org/x/mod/zip"
)

// served is one module the proxy holds.
type served struct {
	module.Version
	Dir   string // slash-separated, relative to the repository's root; "." for the root
	gomod []byte
	file  *modfile.File
}

// buildProxy writes a GOPROXY directory for every module of this repository
// into out. The version is the one given, or else the one every go.mod of
// ours requires of the others (they must agree: one release, one version).
func buildProxy(repo, out, version string, released []string) ([]served, error) {
	files, err := trackedFiles(repo)
	if err != nil {
		return nil, err
	}
	mods, root, err := readModules(repo, files)
	if err != nil {
		return nil, err
	}
	ours := func(p string) bool { return p == root || strings.HasPrefix(p, root+"/") }

	// Every requirement of one of our modules, by whom, so that a mismatch
	// names both go.mod files.
	required := map[string]string{} // version -> "dir requires path"
	for _, m := range mods {
		for _, r := range m.file.Require {
			if ours(r.Mod.Path) {
				required[r.Mod.Version] = fmt.Sprintf("%s/go.mod requires %s@%s", m.Dir, r.Mod.Path, r.Mod.Version)
			}
		}
	}
	if version == "" {
		if len(required) != 1 {
			return nil, fmt.Errorf("no -version, and the go.mod files do not require our modules at one version: %v", values(required))
		}
		for v := range required {
			version = v
		}
	}
	for v, who := range required {
		if v != version {
			return nil, fmt.Errorf("%s; the release is %s: every requirement of ours names the release's version", who, version)
		}
	}
	if !semver.IsValid(version) || module.IsPseudoVersion(version) {
		return nil, fmt.Errorf("version %q: want a release version such as v0.1.0, not a pseudo-version", version)
	}

	for _, dir := range released {
		var found bool
		for _, m := range mods {
			if m.Dir != path.Clean(dir) {
				continue
			}
			found = true
			if len(m.file.Replace) > 0 || len(m.file.Exclude) > 0 {
				return nil, fmt.Errorf("%s/go.mod has replace or exclude directives: a module a user imports (or installs with go install %s/...@%s) must have none; go.work serves the checkout in development", m.Dir, m.Path, version)
			}
		}
		if !found {
			return nil, fmt.Errorf("released module directory %s has no go.mod", dir)
		}
	}

	if err := os.RemoveAll(out); err != nil {
		return nil, err
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, commitTime(repo)})
	if err != nil {
		return nil, err
	}
	for i := range mods {
		m := &mods[i]
		m.Version.Version = version
		if err := writeModule(repo, out, m, files, info); err != nil {
			return nil, err
		}
	}
	return mods, nil
}

// readModules reads every go.mod of the tree, sorted by directory, and
// names the root module's path.
func readModules(repo string, files []string) ([]served, string, error) {
	var mods []served
	for _, f := range files {
		if path.Base(f) != "go.mod" {
			continue
		}
		data, err := os.ReadFile(filepath.Join(repo, filepath.FromSlash(f)))
		if err != nil {
			return nil, "", err
		}
		mf, err := modfile.Parse(f, data, nil)
		if err != nil {
			return nil, "", err
		}
		if mf.Module == nil {
			return nil, "", fmt.Errorf("%s: no module line", f)
		}
		mods = append(mods, served{Version: module.Version{Path: mf.Module.Mod.Path}, Dir: path.Dir(f), gomod: data, file: mf})
	}
	sort.Slice(mods, func(i, j int) bool { return mods[i].Dir < mods[j].Dir })
	var root string
	for _, m := range mods {
		if m.Dir == "." {
			root = m.Path
		}
	}
	if root == "" {
		return nil, "", errors.New("no go.mod at the repository's root")
	}
	return mods, root, nil
}

func writeModule(repo, out string, m *served, files []string, info []byte) error {
	esc, err := module.EscapePath(m.Path)
	if err != nil {
		return err
	}
	vdir := filepath.Join(out, filepath.FromSlash(esc), "@v")
	if err := os.MkdirAll(vdir, 0o755); err != nil {
		return err
	}
	var zfiles []zip.File
	for _, f := range files {
		rel := f
		if m.Dir != "." {
			if !strings.HasPrefix(f, m.Dir+"/") {
				continue
			}
			rel = strings.TrimPrefix(f, m.Dir+"/")
		}
		zfiles = append(zfiles, treeFile{rel: rel, abs: filepath.Join(repo, filepath.FromSlash(f))})
	}
	var buf bytes.Buffer
	if err := zip.Create(&buf, m.Version, zfiles); err != nil {
		return fmt.Errorf("%s: %w", m.Dir, err)
	}
	for name, data := range map[string][]byte{
		"list":                      []byte(m.Version.Version + "\n"),
		m.Version.Version + ".info": info,
		m.Version.Version + ".mod":  m.gomod,
		m.Version.Version + ".zip":  buf.Bytes(),
	} {
		if err := os.WriteFile(filepath.Join(vdir, name), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// trackedFiles lists what a commit of the working tree would hold: the
// files git tracks and the untracked ones it does not ignore (so work in
// progress is served as it is), without those deleted from the tree.
func trackedFiles(repo string) ([]string, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	cmd.Dir = repo
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files: %w", err)
	}
	seen := map[string]bool{}
	var files []string
	for _, f := range strings.Split(string(out), "\x00") {
		if f == "" || seen[f] {
			continue
		}
		seen[f] = true
		if fi, err := os.Lstat(filepath.Join(repo, filepath.FromSlash(f))); err != nil || !fi.Mode().IsRegular() {
			continue
		}
		files = append(files, f)
	}
	sort.Strings(files)
	return files, nil
}

func commitTime(repo string) time.Time {
	cmd := exec.Command("git", "log", "-1", "--format=%cI")
	cmd.Dir = repo
	out, err := cmd.Output()
	if err == nil {
		if t, err := time.Parse(time.RFC3339, strings.TrimSpace(string(out))); err == nil {
			return t.UTC()
		}
	}
	return time.Now().UTC().Truncate(time.Second)
}

func values(m map[string]string) []string {
	var vs []string
	for _, v := range m {
		vs = append(vs, v)
	}
	sort.Strings(vs)
	return vs
}

// treeFile is a file of the working tree, named by its path in the module.
type treeFile struct{ rel, abs string }

func (f treeFile) Path() string                 { return f.rel }
func (f treeFile) Lstat() (os.FileInfo, error)  { return os.Lstat(f.abs) }
func (f treeFile) Open() (io.ReadCloser, error) { return os.Open(f.abs) }
