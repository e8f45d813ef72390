package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
)

// TestServeFlagsAreGrouped: every flag of serve is declared once, in its
// table (serveFlags), with a group, and serve -h prints each under its
// group's title, the groups in the table's order; none is left to
// "Other". A flag bound beside the table, or declared twice, fails here.
func TestServeFlagsAreGrouped(t *testing.T) {
	fs := everyCommand(t)["serve"]
	c := config.Default()
	table := c.ServeFlags()
	declared := map[string]bool{}
	var groups []string
	for _, f := range table {
		require.False(t, declared[f.Name], "--%s is declared twice", f.Name)
		declared[f.Name] = true
		require.NotEmpty(t, f.Group, "--%s has no group", f.Name)
		require.NotNil(t, fs.Lookup(f.Name), "--%s is declared but serve does not have it", f.Name)
		if len(groups) == 0 || groups[len(groups)-1] != f.Group {
			require.NotContains(t, groups, f.Group, "group %q is split in two: keep its flags together", f.Group)
			groups = append(groups, f.Group)
		}
	}
	fs.VisitAll(func(f *flag.Flag) {
		require.True(t, declared[f.Name], "--%s is bound beside serveFlags (flags.go): declare it there", f.Name)
	})

	var stderr bytes.Buffer
	require.ErrorIs(t, run(t.Context(), []string{"serve", "-h"}, io.Discard, &stderr), flag.ErrHelp)
	help := stderr.String()
	require.NotContains(t, help, "\nOther:\n")
	last := 0
	for _, f := range table {
		at := regexp.MustCompile(`(?m)^  -` + regexp.QuoteMeta(f.Name) + `( |$)`).FindStringIndex(help)
		require.NotNil(t, at, "--%s", f.Name)
		require.Greater(t, at[0], last, "--%s is in the table's order", f.Name)
		last = at[0]
		above := regexp.MustCompile(`(?m)^(\S.*):$`).FindAllStringSubmatch(help[:at[0]], -1)
		require.NotEmpty(t, above)
		require.Equal(t, f.Group, above[len(above)-1][1], "--%s is under its group's title", f.Name)
	}
}

// TestHelpText: every command's -h ends with a newline, names each flag's
// type (a duration is "duration", never flag's "value"), and holds none of
// the stale words it once had.
func TestHelpText(t *testing.T) {
	stale := []string{
		"look up and invalidate records",  // the console lists, resolves and shows status too
		"reloaded on SIGHUP)",             // --config is polled as well
		"new-token [flags]",               // it has none
		"answers as JSON",                 // admin prints tables by default
		"schema is up to date",            // migrate -h says what it lists
		"http://ADDR, a loopback address", // --console-allow-remote exists
	}
	for name := range everyCommand(t) {
		t.Run(name, func(t *testing.T) {
			var stderr bytes.Buffer
			require.ErrorIs(t, run(t.Context(), append(strings.Fields(name), "-h"), io.Discard, &stderr), flag.ErrHelp)
			help := stderr.String()
			require.True(t, strings.HasSuffix(help, "\n"), "%q", help)
			require.False(t, strings.HasSuffix(help, "\n\n"), "one newline at the end")
			require.NotRegexp(t, `(?m)^  -\S+ value$`, help)
			for _, s := range stale {
				require.NotContains(t, help, s)
			}
		})
	}
	var stdout bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"admin", "help"}, &stdout, io.Discard))
	require.True(t, strings.HasSuffix(stdout.String(), "\n"))
	require.NotContains(t, stdout.String(), "answers as JSON")
}

// TestDurationFlagsTakeDays: every duration flag of every command, and its
// environment variable, reads durations as the config file does ("7d",
// "1d12h"), and a bad one says what is accepted.
func TestDurationFlagsTakeDays(t *testing.T) {
	n := 0
	for name, fs := range everyCommand(t) {
		fs.VisitAll(func(f *flag.Flag) {
			require.NotEqual(t, "*flag.durationValue", fmt.Sprintf("%T", f.Value),
				"%s --%s is a flag.Duration, which refuses 7d: declare it with cmdline.Duration", name, f.Name)
			if typ, ok := f.Value.(cmdline.Typed); !ok || typ.Type() != "duration" {
				return
			}
			n++
			require.NoError(t, f.Value.Set("7d"), "%s --%s", name, f.Name)
			require.Equal(t, "7d", f.Value.String(), "%s --%s", name, f.Name)
			require.NoError(t, f.Value.Set("1d12h"), "%s --%s", name, f.Name)
			require.Equal(t, (36 * time.Hour).String(), f.Value.String(), "%s --%s", name, f.Name)
			err := f.Value.Set("7x")
			require.ErrorContains(t, err, `like "90s", "1h30m", "7d" or "1d12h"`, "%s --%s", name, f.Name)
		})
	}
	require.Greater(t, n, 30, "the duration flags were found")

	// Through the command line and the environment, as a user gives them.
	cfg := config.Default()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	cfg.BindServe(fs)
	t.Setenv("IDEMREG_MAX_RETENTION", "30d")
	require.NoError(t, parse(fs, []string{"--default-message-retention", "7d", "--max-lease-total", "1d12h", "--sweep-interval", "1d", "--parked-count-interval", "1d"}))
	require.Equal(t, 7*24*time.Hour, cfg.Server.Limits.DefaultMessageRetention)
	require.Equal(t, 30*24*time.Hour, cfg.Server.Limits.MaxRetention)
	require.Equal(t, 36*time.Hour, cfg.Server.Limits.MaxLeaseTotal)
	require.Equal(t, 24*time.Hour, cfg.Sweep.Interval)
	require.Equal(t, 24*time.Hour, cfg.Server.ParkedCountInterval)

	var stderr bytes.Buffer
	err := run(t.Context(), []string{"serve", "--sweep-interval", "7 days"}, io.Discard, &stderr)
	require.ErrorContains(t, err, `invalid value "7 days" for flag -sweep-interval: invalid duration "7 days"`)
	require.ErrorContains(t, err, `like "90s", "1h30m", "7d" or "1d12h"`)
	require.NotContains(t, err.Error(), "parse error")
	err = run(t.Context(), []string{"admin", "list", "--older-than", "2w"}, io.Discard, io.Discard)
	require.ErrorContains(t, err, `"7d"`)
}
