package config

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/server"
)

// serveConfig is serve's Config from the environment and args, as the
// command line reads them.
func serveConfig(t *testing.T, args ...string) *Config {
	t.Helper()
	cfg := Default()
	fs := flag.NewFlagSet("idemreg serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.BindServe(fs)
	require.NoError(t, cmdline.Parse(fs, args))
	return &cfg
}

// TestValidate: the defaults pass; what the flags set that cannot work
// together is refused, each error naming the flag in the words an
// operator typed (a server field's error too: named), a zero the
// libraries would take as their default refused as no bound, and a
// database URL's password never quoted.
func TestValidate(t *testing.T) {
	require.NoError(t, serveConfig(t).Validate())
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"no listen address", []string{"--listen", ""}, []string{"--listen is required"}},
		{"no store", []string{"--data-dir", ""}, []string{"either --database-url or --data-dir is required"}},
		{"not a postgres URL", []string{"--database-url", "mysql://u:secret@h/db"}, []string{`--database-url must be a postgres:// URL, got "mysql://u:xxxxx@h/db"`}},
		{"log format", []string{"--log-format", "xml"}, []string{`--log-format must be json or text, got "xml"`}},
		{"TLS key without its certificate", []string{"--tls-key", "k.pem"}, []string{"--tls-cert and --tls-key go together"}},
		{"client CAs without TLS", []string{"--tls-client-ca", "ca.pem"}, []string{"--tls-client-ca needs --tls-cert and --tls-key"}},
		{"plaintext and TLS", []string{"--plaintext", "--tls-cert", "c.pem", "--tls-key", "k.pem"}, []string{"--plaintext contradicts --tls-cert"}},
		{"plaintext on every interface, unasked", []string{"--listen", ":7350"}, []string{"--listen :7350 is not a loopback address: serve TLS (--tls-cert, --tls-key) or pass --plaintext explicitly"}},
		{"CORS origin", []string{"--http-api-cors-origins", "ftp://x"}, []string{"--http-api-cors-origins"}},
		{"connecting per source", []string{"--max-connecting-per-source", "0"}, []string{"--max-connecting-per-source must be positive, got 0"}},
		{"config poll", []string{"--config-poll", "-1s"}, []string{"--config-poll must not be negative"}},
		{"request timeouts", []string{"--request-timeout", "0s"}, []string{"--request-timeout and --max-request-timeout must be positive"}},
		{"in flight per identity above the whole", []string{"--max-in-flight", "10", "--max-in-flight-per-identity", "11"}, []string{"--max-in-flight-per-identity must be between 0 (half of --max-in-flight) and --max-in-flight (10), got 11"}},
		{"waiters per identity above the whole", []string{"--max-waiters", "4", "--max-waiters-per-identity", "5"}, []string{"--max-waiters-per-identity must be between 0 (half of --max-waiters) and --max-waiters (4), got 5"}},
		{"quota refresh", []string{"--quota-refresh", "500ms"}, []string{"--quota-refresh must be at least 1s"}},
		{"parked count", []string{"--parked-count-interval", "10ms"}, []string{"--parked-count-interval must be at least 1s, or 0"}},
		{"wait recheck", []string{"--wait-recheck", "0s"}, []string{"--wait-recheck must be between 1ms and"}},
		{"bounds", []string{"--max-pending-calls", "0"}, []string{"--max-pending-calls (0)", "must be positive"}},
		{"readiness", []string{"--readiness-max-failure-ratio", "0"}, []string{"--readiness-max-failure-ratio (0) must be positive"}},
		{"shutdown", []string{"--shutdown-timeout", "0s"}, []string{"--shutdown-timeout must be positive"}},
		{"sweep interval", []string{"--sweep-interval", "-1s"}, []string{"--sweep-interval must not be negative (0 turns sweeping off), got -1s"}},
		{"sweep batch", []string{"--sweep-batch-size", "0"}, []string{"the sweep batch size must be positive, got 0"}},
		{"a server field, in the flag's name", []string{"--min-lease", "1h", "--max-lease", "1m"}, []string{"lease bounds"}},
		{"every error at once", []string{"--log-format", "xml", "--shutdown-timeout", "0s"}, []string{"--log-format", "--shutdown-timeout"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := serveConfig(t, tc.args...).Validate()
			require.Error(t, err)
			for _, w := range tc.want {
				require.ErrorContains(t, err, w)
			}
			require.NotContains(t, err.Error(), "secret")
		})
	}
}

// TestNamed: a server's field error is given the name of the flag that
// sets the field, other errors are left as they are.
func TestNamed(t *testing.T) {
	err := named(errors.Join(&server.ConfigError{Field: "Keepalive.MaxConnectionAge", Problem: "must be positive", Value: time.Duration(-1)}, errors.New("other")))
	require.EqualError(t, err, "--max-connection-age must be positive, got -1ns\nother")
}

// TestListenersLoopbackOnly: the console and pprof speak plaintext HTTP
// without a login of their own (the console's sign-in travels in it), so
// --console-listen and --pprof-listen take a loopback address unless
// --console-allow-remote, --pprof-allow-remote say otherwise, from a flag
// or the environment.
func TestListenersLoopbackOnly(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		refused string
	}{
		{"console on loopback", []string{"--console-listen", "127.0.0.1:7351"}, ""},
		{"console on IPv6 loopback", []string{"--console-listen", "[::1]:7351"}, ""},
		{"console on every interface", []string{"--console-listen", ":7351"}, "--console-listen :7351 is not a loopback address"},
		{"console on another interface", []string{"--console-listen", "10.0.0.1:7351"}, "--console-listen 10.0.0.1:7351 is not a loopback address"},
		{"console remote allowed explicitly", []string{"--console-listen", "0.0.0.0:7351", "--console-allow-remote"}, ""},
		{"pprof on loopback", []string{"--pprof-listen", "127.0.0.1:6060"}, ""},
		{"pprof on localhost", []string{"--pprof-listen", "localhost:6060"}, ""},
		{"pprof on IPv6 loopback", []string{"--pprof-listen", "[::1]:6060"}, ""},
		{"pprof on every interface", []string{"--pprof-listen", ":6060"}, "--pprof-listen :6060 is not a loopback address"},
		{"pprof on 0.0.0.0", []string{"--pprof-listen", "0.0.0.0:6060"}, "--pprof-allow-remote"},
		{"pprof on another interface", []string{"--pprof-listen", "10.0.0.1:6060"}, "--pprof-listen 10.0.0.1:6060 is not a loopback address"},
		{"pprof on a name", []string{"--pprof-listen", "idemreg:6060"}, "--pprof-listen idemreg:6060 is not a loopback address"},
		{"pprof remote allowed explicitly", []string{"--pprof-listen", "0.0.0.0:6060", "--pprof-allow-remote"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := serveConfig(t, tc.args...).Validate()
			if tc.refused == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.refused)
		})
	}
	t.Run("from the environment", func(t *testing.T) {
		t.Setenv("IDEMREG_PPROF_LISTEN", "0.0.0.0:6060")
		require.ErrorContains(t, serveConfig(t).Validate(), "--pprof-allow-remote")
		t.Setenv("IDEMREG_PPROF_ALLOW_REMOTE", "true")
		require.NoError(t, serveConfig(t).Validate())
	})
}

// TestConsoleProxyFlags: proxy sign-in is off unless --console-proxy-header
// names the header, needs a user mapping and the proxy's secret (on
// loopback too, where port-forwards arrive), and believes the header from
// the proxy's addresses alone when --console-proxy-from names them.
func TestConsoleProxyFlags(t *testing.T) {
	dir := t.TempDir()
	secret := proxySecretFile(t, dir)
	short := filepath.Join(dir, "short")
	require.NoError(t, os.WriteFile(short, []byte("0123456789abcdef0123456789abcde\n"), 0o600))
	header := func(h, users string, more ...string) []string {
		return append([]string{"--console-proxy-header", h, "--console-proxy-user", users, "--console-proxy-secret-file", secret}, more...)
	}
	cases := []struct {
		name string
		args []string
		err  string
	}{
		{"off", []string{"--console-listen", "127.0.0.1:7351"}, ""},
		{"loopback sidecar", append([]string{"--console-listen", "127.0.0.1:7351"}, header("X-Forwarded-Email", "*@example.com=oncall")...), ""},
		{"loopback without the secret", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*@example.com=oncall"}, "--console-proxy-header needs --console-proxy-secret-file"},
		{"secret too short", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*=x", "--console-proxy-secret-file", short}, "holds 31 bytes: the proxy's secret must have at least 32"},
		{"secret file missing", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*=x", "--console-proxy-secret-file", filepath.Join(dir, "missing")}, "--console-proxy-secret-file: open"},
		{"remote with the proxy's addresses", append([]string{"--console-listen", "0.0.0.0:7351", "--console-allow-remote"}, header("X-Auth-Request-User", "alice=oncall", "--console-proxy-from", "10.0.0.0/8, 192.168.1.7")...), ""},
		{"remote, the secret alone", append([]string{"--console-listen", "0.0.0.0:7351", "--console-allow-remote"}, header("X-Forwarded-Email", "*=oncall")...), ""},
		{"no mapping", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-secret-file", secret}, "--console-proxy-user: no USER=IDENTITY entry"},
		{"bad mapping", append([]string{"--console-listen", "127.0.0.1:7351"}, header("X-Forwarded-Email", "alice")...), `"alice" is not USER=IDENTITY`},
		{"bad address", append([]string{"--console-listen", "127.0.0.1:7351"}, header("X-Forwarded-Email", "*=x", "--console-proxy-from", "proxy.local")...), "neither a CIDR nor an address"},
		{"authorization", append([]string{"--console-listen", "127.0.0.1:7351"}, header("authorization", "*=x")...), "is not a header a proxy names its user in"},
		{"the secret's header", append([]string{"--console-listen", "127.0.0.1:7351"}, header("x-idemreg-proxy-secret", "*=x")...), "is not a header a proxy names its user in"},
		{"no console", header("X-Forwarded-Email", "*=x"), "--console-proxy-header needs --console-listen"},
		{"mapping without header", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-user", "*=x"}, "need --console-proxy-header"},
		{"secret without header", []string{"--console-listen", "127.0.0.1:7351", "--console-proxy-secret-file", secret}, "need --console-proxy-header"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := serveConfig(t, tc.args...)
			err := cfg.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
			require.NotContains(t, err.Error(), testProxySecret, "the secret is never quoted")
		})
	}
}

// TestParkedCountFlag: --parked-count-interval (IDEMREG_PARKED_COUNT_INTERVAL)
// reaches the server's Config, 0 turning the gauge off.
func TestParkedCountFlag(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  string
		want time.Duration
	}{
		{"default", nil, "", server.DefaultParkedCountInterval},
		{"flag", []string{"--parked-count-interval", "5m"}, "", 5 * time.Minute},
		{"environment", nil, "30s", 30 * time.Second},
		{"the flag wins", []string{"--parked-count-interval", "2m"}, "30s", 2 * time.Minute},
		{"off", []string{"--parked-count-interval", "0"}, "", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv("IDEMREG_PARKED_COUNT_INTERVAL", tc.env)
			}
			cfg := serveConfig(t, tc.args...)
			require.NoError(t, cfg.Validate())
			require.Equal(t, tc.want, cfg.Server.ParkedCountInterval)
		})
	}
}

// testProxySecret is the secret of the tests' proxy.
const testProxySecret = "7f3c9a0e5b1d4c8f2a6e0b9d3c7f1a5e8b2d6c0f4a9e3b7d1c5f8a2e6b0d4c9f"

// proxySecretFile writes testProxySecret, as echo would, to a file in
// dir and returns its path.
func proxySecretFile(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "console-proxy-secret")
	require.NoError(t, os.WriteFile(path, []byte(testProxySecret+"\n"), 0o600))
	return path
}
