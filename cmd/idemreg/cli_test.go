package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/admincli"
	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/stretchr/testify/require"
)

// everyCommand is every command's name as run takes it and its flags, as
// run binds them.
func everyCommand(t *testing.T) map[string]*flag.FlagSet {
	t.Helper()
	out := map[string]*flag.FlagSet{}
	for name, cmd := range commands {
		out[name], _ = flagSet(name, "", io.Discard, cmd.run)
	}
	for name, cmd := range admincli.Commands {
		out["admin "+name], _ = flagSet("admin "+name, "", io.Discard, adminCommand(cmd))
	}
	return out
}

// TestFlagsShowTheirEnvironment walks every command's flags: each one's
// help names the IDEMREG_* variable that sets it, and -h prints it.
func TestFlagsShowTheirEnvironment(t *testing.T) {
	for name, fs := range everyCommand(t) {
		t.Run(name, func(t *testing.T) {
			var stderr bytes.Buffer
			err := run(t.Context(), append(strings.Fields(name), "-h"), io.Discard, &stderr)
			require.ErrorIs(t, err, flag.ErrHelp)
			require.Contains(t, stderr.String(), "usage: idemreg "+name)
			fs.VisitAll(func(f *flag.Flag) {
				env := "$IDEMREG_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
				require.Contains(t, f.Usage, env, "--%s", f.Name)
				require.Regexp(t, `(?m)^  -`+f.Name+`( |$)`, stderr.String(), "-h lists --%s", f.Name)
				require.Contains(t, stderr.String(), env+")", "-h names --%s's variable", f.Name)
			})
		})
	}
}

// TestCommandFlags: each command lists only the flags it acts on.
func TestCommandFlags(t *testing.T) {
	names := func(fs *flag.FlagSet) []string {
		var out []string
		fs.VisitAll(func(f *flag.Flag) { out = append(out, f.Name) })
		return out
	}
	cmds := everyCommand(t)
	require.Equal(t, []string{"cockroach-ttl", "database-url"}, names(cmds["migrate"]))
	require.Equal(t, []string{"batch-size", "batch-timeout", "data-dir", "database-url", "log-format", "log-level", "max-duration", "pause"}, names(cmds["sweep"]))
	require.Equal(t, []string{"addr", "service", "timeout"}, names(cmds["health"]))
	require.Empty(t, names(cmds["new-token"]))
	require.Empty(t, names(cmds["version"]))
	require.Contains(t, names(cmds["serve"]), "max-in-flight")
	require.NotContains(t, names(cmds["serve"]), "batch-size", "sweep's, which serve spells --sweep-batch-size")

	var stderr bytes.Buffer
	require.ErrorIs(t, run(t.Context(), []string{"migrate", "-h"}, io.Discard, &stderr), flag.ErrHelp)
	require.NotContains(t, stderr.String(), "data-dir", "migrate's help says nothing of the embedded store's flags")

	err := run(t.Context(), []string{"new-token", "extra"}, io.Discard, io.Discard)
	require.ErrorContains(t, err, `new-token: unexpected arguments ["extra"]`)
}

// TestHelpExitsZero runs the binary: -h and --help exit 0 at the top and
// for every command, without starting anything.
func TestHelpExitsZero(t *testing.T) {
	bin := servetest.Binary(t)
	runs := [][]string{{"-h"}, {"--help"}, {"help"}, {"admin", "-h"}}
	for name := range everyCommand(t) {
		for _, h := range []string{"-h", "--help"} {
			runs = append(runs, append(strings.Fields(name), h))
		}
	}
	for _, args := range runs {
		out, err := exec.CommandContext(t.Context(), bin, args...).CombinedOutput()
		require.NoError(t, err, "idemreg %s: %s", strings.Join(args, " "), out)
		require.NotEmpty(t, out, "idemreg %s prints its help", strings.Join(args, " "))
	}
	out, err := exec.CommandContext(t.Context(), bin, "serve", "--no-such-flag").CombinedOutput()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "%s", out)
	require.Equal(t, 2, exit.ExitCode(), "a wrong flag is still an error")
}

// TestHelpHidesSecrets: what the environment sets is never printed as a
// flag's default.
func TestHelpHidesSecrets(t *testing.T) {
	t.Setenv("IDEMREG_TOKEN", "S3cretToken")
	t.Setenv("IDEMREG_DATABASE_URL", "postgres://u:S3cretPw@db/idemreg")
	for _, args := range [][]string{{"admin", "inspect", "-h"}, {"serve", "-h"}, {"migrate", "-h"}, {"sweep", "-h"}} {
		var stderr bytes.Buffer
		require.ErrorIs(t, run(t.Context(), args, io.Discard, &stderr), flag.ErrHelp)
		require.NotContains(t, stderr.String(), "S3cret", strings.Join(args, " "))
	}
}

// TestVersion: version and --version print the same build (what each line
// says is versioncmd's TestText).
func TestVersion(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"version"}, &out, io.Discard))
	require.Regexp(t, `^idemreg \S+\nrevision: \S+\ntime:     \S+\ngo:       `+regexp.QuoteMeta(runtime.Version())+"\n$", out.String())
	var alias bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"--version"}, &alias, io.Discard))
	require.Equal(t, out.String(), alias.String())
}
