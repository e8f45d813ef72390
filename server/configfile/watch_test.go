package configfile_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
)

// logged is a slog.Handler that hands each record to the test, which
// waits on it: a reload is seen when Watch says it is done.
type logged chan slog.Record

func (l logged) Enabled(context.Context, slog.Level) bool { return true }
func (l logged) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l logged) WithGroup(string) slog.Handler            { return l }
func (l logged) Handle(_ context.Context, r slog.Record) error {
	l <- r.Clone()
	return nil
}

// next is the next record Watch logs, with its attributes as strings.
func (l logged) next(t *testing.T) (string, map[string]string) {
	t.Helper()
	select {
	case r := <-l:
		attrs := map[string]string{}
		r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
		return r.Message, attrs
	case <-time.After(10 * time.Second):
		t.Fatal("Watch logged nothing")
		return "", nil
	}
}

// watch runs src.Watch until the test ends.
func watch(t *testing.T, src *configfile.Source, poll time.Duration) (hup chan os.Signal, logs logged) {
	t.Helper()
	hup, logs = make(chan os.Signal, 1), make(logged, 16)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); src.Watch(ctx, poll, hup, slog.New(logs)) }()
	t.Cleanup(func() { cancel(); <-done })
	return hup, logs
}

// TestWatchSIGHUP: each SIGHUP reloads the file, whole or not at all, and
// says which version is in force; without a file, it is ignored, and said.
func TestWatchSIGHUP(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	write("consumers:\n  - {name: a.b, lease: {default: 1m}}\n")
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	first := src.Current()
	hup, logs := watch(t, src, 0)

	write("consumers:\n  - {name: a.b, lease: {default: 2m}}\n")
	hup <- syscall.SIGHUP
	msg, attrs := logs.next(t)
	require.Equal(t, "config reloaded", msg)
	require.Equal(t, "SIGHUP", attrs["trigger"])
	require.Equal(t, src.Current().Version, attrs["version"])
	require.NotEqual(t, first.Version, attrs["version"])
	second := src.Current()

	// Valid policy, invalid access: the whole file is refused, and the
	// version in force named.
	write("consumers:\n  - {name: a.b, lease: {default: 3m}}\nrate_limits:\n  - {consumers: [\"a.*\"], rate: 0}\n")
	hup <- syscall.SIGHUP
	msg, attrs = logs.next(t)
	require.Equal(t, "config reload rejected; the policy and access in force stay", msg)
	require.Contains(t, attrs["error"], "rate_limits[0]")
	require.Equal(t, second.Version, attrs["version"])
	require.Same(t, second, src.Current())

	static := configfile.Static(&configfile.Config{Access: access.Open()})
	hup, logs = watch(t, static, time.Millisecond)
	hup <- syscall.SIGHUP
	msg, _ = logs.next(t)
	require.Equal(t, "SIGHUP ignored: no config file (--config) to reload", msg)
}

// TestWatchPolls: a file changed on disk is taken without a signal once a
// poll has read it unchanged for two polls' time, and a file refused is
// said once, not on every poll.
func TestWatchPolls(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	write("consumers:\n  - {name: a.b, lease: {default: 1m}}\n")
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	_, logs := watch(t, src, 5*time.Millisecond)

	write("consumers:\n  - {name: a.b, lease: {default: 2m}}\n")
	msg, attrs := logs.next(t)
	require.Equal(t, "config reloaded", msg)
	require.Equal(t, "file changed", attrs["trigger"])
	require.Equal(t, src.Current().Version, attrs["version"])

	write("consumers: [\n")
	msg, attrs = logs.next(t)
	require.Equal(t, "config reload rejected; the policy and access in force stay", msg)
	require.Equal(t, "file changed", attrs["trigger"])

	// Fixed again: the next line is the reload, not the broken file again.
	write("consumers:\n  - {name: a.b, lease: {default: 3m}}\n")
	msg, _ = logs.next(t)
	require.Equal(t, "config reloaded", msg)
}
