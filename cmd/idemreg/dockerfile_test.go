package main

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// dockerInstruction is one instruction of a Dockerfile, its continuation
// lines joined and its comments dropped.
type dockerInstruction struct {
	cmd  string // FROM, RUN, COPY, ...
	args string
}

// dockerInstructions splits a Dockerfile into its instructions. It reads
// the subset of the syntax the repository's Dockerfile uses (no heredocs,
// no escape directive): enough for the structural checks below, which
// stand in for a docker build that this machine and CI cannot run.
func dockerInstructions(docker string) []dockerInstruction {
	var out []dockerInstruction
	var cur strings.Builder
	for line := range strings.Lines(docker) {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		cont := strings.HasSuffix(line, "\\")
		cur.WriteString(strings.TrimSuffix(line, "\\"))
		if cont {
			cur.WriteString(" ")
			continue
		}
		cmd, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, dockerInstruction{strings.ToUpper(cmd), strings.Join(strings.Fields(args), " ")})
		cur.Reset()
	}
	return out
}

// TestDockerfileCrossCompilesAndCaches checks the build stage's shape
// (structurally: docker does not run here): it runs on the builder's
// platform and cross-compiles for the target's; the modules are downloaded
// from go.mod and go.sum alone, before any source is copied, so a source
// edit does not download them again; and the module and build caches are
// BuildKit cache mounts. The final stage is per target platform and takes
// only files.
func TestDockerfileCrossCompilesAndCaches(t *testing.T) {
	raw, err := os.ReadFile("../../Dockerfile")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(raw), "# syntax=docker/dockerfile:1\n"), "the Dockerfile frontend that knows RUN --mount")
	ins := dockerInstructions(string(raw))

	var stages [][]dockerInstruction
	for _, in := range ins {
		if in.cmd == "FROM" {
			stages = append(stages, nil)
		}
		require.NotEmpty(t, stages, "%s before the first FROM", in.cmd)
		stages[len(stages)-1] = append(stages[len(stages)-1], in)
	}
	require.Len(t, stages, 2, "a build stage and the final image")
	build, final := stages[0], stages[1]
	require.True(t, strings.HasPrefix(build[0].args, "--platform=$BUILDPLATFORM "), "the build stage runs natively: %s", build[0].args)
	require.NotContains(t, final[0].args, "--platform", "the final image is the target platform's")
	for _, in := range final {
		require.NotEqual(t, "RUN", in.cmd, "the final stage runs nothing, so it needs no emulation: %s", in.args)
	}

	modCache := "--mount=type=cache,target=/go/pkg/mod"
	buildCache := "--mount=type=cache,target=/root/.cache/go-build"
	download := slices.IndexFunc(build, func(in dockerInstruction) bool {
		return in.cmd == "RUN" && strings.Contains(in.args, "go mod download")
	})
	require.GreaterOrEqual(t, download, 0, "the modules downloaded in a step of their own")
	require.Contains(t, build[download].args, modCache)
	for _, in := range build[:download] {
		if in.cmd != "COPY" {
			continue
		}
		srcs := strings.Fields(in.args)
		for _, src := range srcs[:len(srcs)-1] {
			require.Contains(t, []string{"go.mod", "go.sum"}, filepath.Base(src), "only go.mod and go.sum before the download: COPY %s", in.args)
		}
	}

	makeRun := slices.IndexFunc(build, func(in dockerInstruction) bool {
		return in.cmd == "RUN" && strings.Contains(in.args, "make build")
	})
	require.Greater(t, makeRun, download)
	run := build[makeRun].args
	require.Contains(t, run, modCache)
	require.Contains(t, run, buildCache)
	require.Regexp(t, `(^| )GOOS=\$TARGETOS GOARCH=\$TARGETARCH make build `, run, "cross-compiled for the target")
	for _, v := range []string{"VERSION", "REVISION", "REVISION_TIME"} {
		require.Contains(t, run, " "+v+`="$`+v+`"`, "make build stamps the version from the build argument %s", v)
	}
	var args []string
	sourceCopied := false
	for _, in := range build[:makeRun] {
		switch {
		case in.cmd == "ARG":
			args = append(args, strings.Fields(in.args)...)
		case in.cmd == "COPY" && strings.HasPrefix(in.args, ". "):
			sourceCopied = true
		}
	}
	require.True(t, sourceCopied)
	for _, a := range []string{"TARGETOS", "TARGETARCH"} {
		require.Contains(t, args, a, "declared in the build stage, or it is empty there")
	}
	for _, a := range []string{"VERSION", "REVISION", "REVISION_TIME"} {
		require.True(t, slices.ContainsFunc(args, func(s string) bool { return strings.HasPrefix(s, a+"=") }), "ARG %s in the build stage", a)
	}
}

// dockerIgnored reports whether the .dockerignore patterns leave path (a
// slash-separated path relative to the context) out of the build context:
// the last pattern that matches the path or one of its parent directories
// decides, "!" admits, "**" spans directories (Docker's rules, as
// moby/patternmatcher applies them).
func dockerIgnored(patterns []string, path string) bool {
	ignored := false
	for _, p := range patterns {
		admit := strings.HasPrefix(p, "!")
		p = strings.TrimSuffix(strings.TrimPrefix(p, "!"), "/")
		var re strings.Builder
		re.WriteString("^")
		for i := 0; i < len(p); i++ {
			switch {
			case strings.HasPrefix(p[i:], "**/"):
				re.WriteString("(.*/)?")
				i += 2
			case strings.HasPrefix(p[i:], "**"):
				re.WriteString(".*")
				i++
			case p[i] == '*':
				re.WriteString("[^/]*")
			case p[i] == '?':
				re.WriteString("[^/]")
			default:
				re.WriteString(regexp.QuoteMeta(p[i : i+1]))
			}
		}
		re.WriteString("(/.*)?$")
		if regexp.MustCompile(re.String()).MatchString(path) {
			ignored = !admit
		}
	}
	return ignored
}

func TestDockerIgnoreMatcher(t *testing.T) {
	patterns := []string{"*", "!cmd/", "**/*_test.go", "**/testdata"}
	for path, want := range map[string]bool{
		"README.md": true, "docs/x.md": true, "cmd/idemreg/main.go": false, "cmd/idemreg/main_test.go": true,
		"cmd/a/testdata/b.json": true, "cmd": false, ".git/HEAD": true,
	} {
		require.Equal(t, want, dockerIgnored(patterns, path), path)
	}
}

// TestDockerIgnoreAdmitsTheBuild checks .dockerignore against what make
// build compiles: every Go and embedded file of every package of this
// repository that cmd/idemreg is built from (go list -deps), and the
// go.mod, go.sum and Makefile the Dockerfile copies, are in the build
// context; docs, manifests, the system tests, the other clients and .git
// are not, so that editing them changes no layer.
func TestDockerIgnoreAdmitsTheBuild(t *testing.T) {
	raw, err := os.ReadFile("../../.dockerignore")
	require.NoError(t, err)
	var patterns []string
	for line := range strings.Lines(string(raw)) {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			patterns = append(patterns, line)
		}
	}
	root, err := filepath.Abs("../..")
	require.NoError(t, err)

	cmd := exec.CommandContext(t.Context(), "go", "list", "-deps", "-json=Dir,GoFiles,EmbedFiles,Standard", ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	require.NoError(t, err)
	var files []string
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var pkg struct {
			Dir                 string
			GoFiles, EmbedFiles []string
			Standard            bool
		}
		if err := dec.Decode(&pkg); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		rel, err := filepath.Rel(root, pkg.Dir)
		require.NoError(t, err)
		if pkg.Standard || strings.HasPrefix(rel, "..") {
			continue // the standard library, or the module cache
		}
		for _, f := range append(pkg.GoFiles, pkg.EmbedFiles...) {
			files = append(files, filepath.ToSlash(filepath.Join(rel, f)))
		}
	}
	require.Contains(t, files, "cmd/idemreg/main.go", "go list saw the binary's own package")
	require.Contains(t, files, "storage/postgres/migrate.go", "and the packages it imports")
	files = append(files, "Makefile", "go.mod", "go.sum", "proto/go.mod", "proto/go.sum", "client/go.mod", "client/go.sum")
	for _, f := range files {
		require.False(t, dockerIgnored(patterns, f), ".dockerignore leaves %s out of the build context, and make build needs it", f)
	}
	for _, f := range []string{"README.md", "docs/operations.md", "deploy/base/idemreg.yaml", "tests/go.mod", "examples/go.mod",
		"clients/typescript/package.json", ".ci/test", ".git/HEAD", "cmd/idemreg/main_test.go", "Dockerfile"} {
		require.True(t, dockerIgnored(patterns, f), "%s is in the build context, so editing it would change the source layer", f)
	}
}
