package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/sweepcmd"
	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// runSweep runs `idemreg sweep` and returns its stdout, stderr and exit
// status.
func runSweep(t *testing.T, bin string, env []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append([]string{"sweep"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return out.String(), errOut.String(), exit.ExitCode()
	}
	require.NoError(t, err)
	return out.String(), errOut.String(), 0
}

// insertRecords inserts n records of consumer expiring at the SQL
// expression expires (of i, the row number, and now()) straight into the
// database: the store's clock cannot be moved from outside the process.
func insertRecords(t *testing.T, dbURL, consumer string, n int, expires string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), fmt.Sprintf(`
INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result)
SELECT $1, 1, 'key-' || i, 2, '\x'::bytea, 1000 + i, 1, 'fixture',
       e - interval '2 hours', e - interval '1 hour', e - interval '1 hour', e, 3600000000, '\x0a00'::bytea
FROM (SELECT i, %s AS e FROM generate_series(0, $2 - 1) AS i) AS g`, expires), consumer, n)
	require.NoError(t, err)
}

func countRows(t *testing.T, dbURL string) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT count(*) FROM idemreg_records`).Scan(&n))
	return n
}

// logLines returns the JSON log lines of stderr with the given message.
func logLines(t *testing.T, stderr, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(stderr), "\n") {
		var m map[string]any
		if raw := []byte(line); len(raw) > 0 && raw[0] == '{' {
			require.NoError(t, json.Unmarshal(raw, &m), "log line %s", line)
			if m["msg"] == msg {
				out = append(out, m)
			}
		}
	}
	return out
}

// TestSweepPostgres sweeps a database holding expired and live records,
// through the binary, as the CronJob in deploy/ runs it.
func TestSweepPostgres(t *testing.T) {
	bin := servetest.Binary(t)
	dbURL := pgtest.NewDatabase(t)
	insertRecords(t, dbURL, "expired", 2500, "now() - interval '1 millisecond' - i * interval '1 second'")
	insertRecords(t, dbURL, "live", 5, "now() + interval '1 hour'")
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "secret") // trust auth ignores it; logs must not show it
	env := []string{"IDEMREG_DATABASE_URL=" + u.String()}

	stdout, stderr, code := runSweep(t, bin, env, "--batch-size", "1000")
	require.Zero(t, code, "stderr: %s", stderr)
	require.Contains(t, stdout, "sweep finished: deleted 2500 expired records in 3 batches (0 failed)")
	require.Contains(t, stdout, "the next record expires at")
	require.NotContains(t, stderr, "secret")
	finished := logLines(t, stderr, "sweep finished")
	require.Len(t, finished, 1)
	require.EqualValues(t, 2500, finished[0]["deleted"])
	require.Equal(t, "finished", finished[0]["stop"])
	require.Len(t, logLines(t, stderr, "sweeping"), 1)
	require.Equal(t, 5, countRows(t, dbURL), "the live records are kept")

	stdout, _, code = runSweep(t, bin, env)
	require.Zero(t, code)
	require.Contains(t, stdout, "deleted 0 expired records in 1 batches")
}

// TestSweepMaxDuration stops a sweep of a backlog at --max-duration: exit
// status 3, with what it did.
func TestSweepMaxDuration(t *testing.T) {
	bin := servetest.Binary(t)
	dbURL := pgtest.NewDatabase(t)
	insertRecords(t, dbURL, "expired", 5000, "now() - interval '1 hour' - i * interval '1 millisecond'")
	stdout, stderr, code := runSweep(t, bin, []string{"IDEMREG_DATABASE_URL=" + dbURL},
		"--batch-size", "10", "--pause", "20ms", "--max-duration", "300ms", "--log-format", "text")
	require.Equal(t, sweepcmd.ExitMaxReached, code, "stderr: %s", stderr)
	require.Contains(t, stderr, "idemreg: sweep did not finish: --max-duration 300ms ran out with expired records left")
	require.Contains(t, stdout, "sweep max_duration: deleted ")
	require.Contains(t, stdout, "the oldest record left expired 1h")
	left := countRows(t, dbURL)
	require.Less(t, left, 5000)
	require.Positive(t, left)
}

func TestSweepStoreDown(t *testing.T) {
	bin := servetest.Binary(t)
	addr := servetest.FreeAddr(t) // nothing listens there
	_, stderr, code := runSweep(t, bin, nil, "--database-url", "postgres://postgres@"+addr+"/idemreg?sslmode=disable&connect_timeout=1")
	require.Equal(t, sweepcmd.ExitFailed, code)
	require.Contains(t, stderr, "idemreg: the store does not answer")
}

// TestSweepEmbedded claims records with the shortest retention through a
// server on the embedded store, and sweeps them with the binary: refused
// while the server holds the store, done once it stopped.
func TestSweepEmbedded(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	p := servetest.Start(t, bin, dir, nil, "--min-lease", "1ms", "--min-retention", "1ms", "--sweep-interval", "0")
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	for i := range 30 {
		_, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: fmt.Sprint(i), Lease: durationpb.New(time.Millisecond), Retention: durationpb.New(time.Millisecond)})
		require.NoError(t, err)
	}
	_, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "live"})
	require.NoError(t, err)
	dataDir := filepath.Join(dir, "idemreg-data")

	_, stderr, code := runSweep(t, bin, nil, "--data-dir", dataDir)
	require.Equal(t, sweepcmd.ExitFailed, code)
	require.Contains(t, stderr, "a running idemreg serve holds it, and sweeps it itself with --sweep-interval")

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait())
	stdout, stderr, code := runSweep(t, bin, nil, "--data-dir", dataDir)
	require.Zero(t, code, "stderr: %s", stderr)
	require.Contains(t, stdout, "sweep finished: deleted 30 expired records")

	_, stderr, code = runSweep(t, bin, nil, "--data-dir", filepath.Join(dir, "typo"))
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "no embedded store in --data-dir")
	require.NoDirExists(t, filepath.Join(dir, "typo"), "a mistyped directory is not created")
}

// TestServeSweeps runs the in-process sweeper: records claimed with the
// shortest retention are deleted by serve itself, and its metrics are
// exported with the service's.
func TestServeSweeps(t *testing.T) {
	bin := servetest.Binary(t)
	metricsAddr := servetest.FreeAddr(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--min-lease", "1ms", "--min-retention", "1ms", "--sweep-interval", "100ms",
		"--metrics-listen", metricsAddr)
	p.WaitLog(t, "sweeper on")
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	const n = 20
	for i := range n {
		_, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "cmd.test", Kind: idemregv1.Kind_KIND_OPERATION,
			Key: fmt.Sprint(i), Lease: durationpb.New(time.Millisecond), Retention: durationpb.New(time.Millisecond)})
		require.NoError(t, err)
	}
	deleted := 0
	for deleted < n {
		line := p.WaitLog(t, "sweep finished")
		require.Equal(t, "sweeper", line["component"])
		deleted += int(line["deleted"].(float64))
	}
	require.Equal(t, n, deleted)

	res, err := http.Get("http://" + metricsAddr + "/metrics")
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	metrics := string(body)
	require.Contains(t, metrics, "idemreg_sweeper_deleted_total")
	require.Regexp(t, `idemreg_sweeper_deleted_total(\{[^}]*\})? 20\n`, metrics) // no labels: no scope labels since issue 30
	for _, name := range []string{"idemreg_sweeper_batches_total", "idemreg_sweeper_lag_seconds", "idemreg_sweeper_batch_size",
		"idemreg_sweeper_batch_duration_seconds_bucket", "idemreg_sweeper_pass_duration_seconds_count"} {
		require.Contains(t, metrics, name)
	}

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	p.WaitLog(t, "stopped")
	require.NoError(t, p.Cmd.Wait())
}

// TestServePolicyReload serves with a policy file, and replaces it on
// SIGHUP; an invalid file is rejected and the policy in force stays.
func TestServePolicyReload(t *testing.T) {
	bin := servetest.Binary(t)
	path := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 8d, default: 10d}\n")
	p := servetest.Start(t, bin, t.TempDir(), nil, "--config", path)
	loaded := p.WaitLog(t, "config loaded")
	require.EqualValues(t, 1, loaded["consumer_policies"])
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	claim := func(key string, retention time.Duration) (*idemregv1.ClaimResponse, error) {
		r := &idemregv1.ClaimRequest{Consumer: "orders.inbox", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key}
		if retention > 0 {
			r.Retention = durationpb.New(retention)
		}
		return c.Claim(t.Context(), r)
	}

	res, err := claim("m-1", 0)
	require.NoError(t, err)
	require.Equal(t, 10*24*time.Hour, res.GetRecord().GetExpiresAt().AsTime().Sub(res.GetRecord().GetLeaseExpiresAt().AsTime()))
	_, err = claim("m-2", 2*time.Hour)
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), `must be at least 8d (message_retention.min of prefix "orders.")`)

	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 1h}\n")
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	p.WaitLog(t, "config reloaded")
	_, err = claim("m-2", 2*time.Hour)
	require.NoError(t, err, "the reloaded policy is in force")

	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 30m}\n")
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	line := p.WaitLog(t, "config reload rejected; the policy and access in force stay")
	require.Contains(t, line["error"], "message_retention.default 30m0s is below message_retention.min 1h0m0s")
	require.Equal(t, path, line["path"])
	_, err = claim("m-3", 30*time.Minute)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "the last valid policy stays")
	_, err = claim("m-4", 2*time.Hour)
	require.NoError(t, err)

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait())
}

func TestSweepAndPolicyConfigErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("consumers:\n  - prefix: a.\n    lease: {default: 2h}\n"), 0o600))
	cases := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"zero batch size", []string{"sweep", "--batch-size", "0"}, nil, "the sweep batch size must be positive"},
		{"zero batch timeout", []string{"sweep", "--batch-timeout", "0s"}, nil, "the sweep batch timeout must be positive"},
		{"negative max duration", []string{"sweep", "--max-duration", "-1s"}, nil, "max duration must not be negative"},
		{"bad batch size in the environment", []string{"sweep"}, map[string]string{"IDEMREG_BATCH_SIZE": "many"}, "IDEMREG_BATCH_SIZE"},
		{"sweep bad database url", []string{"sweep", "--database-url", "mysql://u:secret@h/db"}, nil, "--database-url must be a postgres:// URL"},
		{"sweep no data dir", []string{"sweep", "--data-dir", filepath.Join(dir, "none")}, nil, "no embedded store in --data-dir"},
		{"negative sweep interval", []string{"serve", "--sweep-interval", "-1s"}, nil, "--sweep-interval must not be negative"},
		{"missing policy file", []string{"serve", "--config", filepath.Join(dir, "none.yaml")}, nil, "config file: open"},
		{"invalid policy file", []string{"serve", "--config", bad}, nil, `consumers[0]: prefix "a.": lease.default 2h0m0s is above lease.max 1h0m0s`},
		{"policy file against the flags", []string{"serve", "--config", bad, "--max-lease", "3h"}, nil, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			os.Unsetenv("IDEMREG_DATABASE_URL")
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var out, errOut bytes.Buffer
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			if tc.want == "" {
				// The same file is valid once the flags allow it: serve
				// starts, and stops with the context.
				cancel()
				err := run(ctx, append(tc.args, "--listen", servetest.FreeAddr(t), "--data-dir", t.TempDir()), &out, &errOut)
				require.NoError(t, err)
				return
			}
			err := run(ctx, tc.args, &out, &errOut)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "secret")
		})
	}
}

// TestSweepRowLevelTTL: on a database migrated with --cockroach-ttl (faked
// here in the bookkeeping: PostgreSQL has no row-level TTL, and migrate
// refuses the flag there), `idemreg sweep` refuses and serve does not start
// its sweeper.
func TestSweepRowLevelTTL(t *testing.T) {
	bin := servetest.Binary(t)
	dbURL := pgtest.NewDatabase(t)
	out, err := exec.CommandContext(t.Context(), bin, "migrate", "--database-url", dbURL, "--cockroach-ttl").CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "row-level TTL needs CockroachDB")

	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	_, err = conn.Exec(t.Context(), `INSERT INTO idemreg_schema_migrations (name, variant) VALUES ('ttl_0001_row_level_ttl.sql', 'cockroach-ttl')`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(t.Context()))

	_, stderr, code := runSweep(t, bin, []string{"IDEMREG_DATABASE_URL=" + dbURL})
	require.Equal(t, sweepcmd.ExitFailed, code)
	require.Contains(t, stderr, "row-level TTL")

	p := servetest.Start(t, bin, t.TempDir(), nil, "--database-url", dbURL, "--sweep-interval", "100ms")
	p.WaitLog(t, "sweeper off: CockroachDB's row-level TTL deletes expired records (idemreg migrate --cockroach-ttl)")
	p.WaitLog(t, "serving")
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	p.WaitLog(t, "stopped")
	require.NoError(t, p.Cmd.Wait())
}
