package cmdline_test

import (
	"bytes"
	"flag"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
)

// settings is what the test's flags set.
type settings struct {
	listen  string
	workers int
	recheck time.Duration
	window  uint32
	plain   bool
}

func (s *settings) table() []cmdline.Flag {
	var table []cmdline.Flag
	table = append(table, cmdline.Group("Listeners",
		cmdline.String(&s.listen, "listen", "address"),
		cmdline.Bool(&s.plain, "plaintext", "no TLS"))...)
	return append(table, cmdline.Group("Limits",
		cmdline.OffAtZero(&s.workers, strconv.Atoi, "workers", "goroutines kept (0: none)"),
		cmdline.Duration(&s.recheck, "recheck", "how often"),
		cmdline.Uint32(&s.window, "window", "bytes"))...)
}

func bind(t *testing.T) (*flag.FlagSet, *settings, []cmdline.Flag) {
	t.Helper()
	s := &settings{listen: "127.0.0.1:7350", recheck: time.Second, workers: 4}
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	table := s.table()
	cmdline.Bind(fs, table...)
	return fs, s, table
}

// TestParse: the environment is read first and a flag given wins; a bad
// value in the environment names its variable; the defaults are the
// variables' values when bound.
func TestParse(t *testing.T) {
	fs, s, _ := bind(t)
	require.Equal(t, "127.0.0.1:7350", fs.Lookup("listen").DefValue)
	t.Setenv("IDEMREG_LISTEN", "127.0.0.1:1")
	t.Setenv("IDEMREG_RECHECK", "1d")
	t.Setenv("IDEMREG_PLAINTEXT", "true")
	require.NoError(t, cmdline.Parse(fs, []string{"--listen", "127.0.0.1:2", "--workers", "0", "--window", "65536"}))
	require.Equal(t, "127.0.0.1:2", s.listen, "the flag wins")
	require.Equal(t, 24*time.Hour, s.recheck, "from the environment, in days")
	require.True(t, s.plain)
	require.Equal(t, -1, s.workers, "0 turns it off: the library's negative")
	require.Equal(t, uint32(65536), s.window)

	fs, _, _ = bind(t)
	t.Setenv("IDEMREG_WORKERS", "-1")
	require.ErrorContains(t, cmdline.Parse(fs, nil), "IDEMREG_WORKERS: --workers must not be negative (0 turns it off)")
	require.Equal(t, "IDEMREG_MAX_IN_FLIGHT", cmdline.EnvName("max-in-flight"))
}

// TestPrint: a table prints its groups in order, each flag's type named
// and its environment variable at the end of its help; a flag bound
// beside the table goes under "Other"; without a table, name order.
func TestPrint(t *testing.T) {
	fs, _, table := bind(t)
	cmdline.Bind(fs, cmdline.Duration(new(time.Duration), "stray", "bound beside the table"))
	cmdline.NameEnv(fs)
	var b bytes.Buffer
	cmdline.Print(&b, fs, table)
	require.Equal(t, `
Listeners:
  -listen string
    	address ($IDEMREG_LISTEN) (default "127.0.0.1:7350")
  -plaintext
    	no TLS ($IDEMREG_PLAINTEXT)

Limits:
  -workers int
    	goroutines kept (0: none) ($IDEMREG_WORKERS) (default 4)
  -recheck duration
    	how often ($IDEMREG_RECHECK) (default 1s)
  -window uint
    	bytes ($IDEMREG_WINDOW)

Other:
  -stray duration
    	bound beside the table ($IDEMREG_STRAY)
`, b.String())

	b.Reset()
	cmdline.Print(&b, fs, nil)
	require.Regexp(t, `^  -listen string\n(.*\n)*  -plaintext\n(.*\n)*  -recheck duration\n(.*\n)*  -stray duration\n(.*\n)*  -window uint\n(.*\n)*  -workers int\n`, b.String())
	require.NotContains(t, b.String(), ":\n")
}
