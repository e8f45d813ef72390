package main

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// TestServeConfigReloadIsAtomic: a SIGHUP takes the config file whole or
// not at all. A file whose policy part is valid and whose access part is
// not changes neither part; a valid file changes both.
func TestServeConfigReloadIsAtomic(t *testing.T) {
	bin := servetest.Binary(t)
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	identity := func(consumers string) string {
		return "identities:\n  - {name: orders, token_hashes: [\"" + access.HashToken("orders-token") + "\"], consumers: [" + consumers + "]}\n"
	}
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	strictPolicy := "consumers:\n  - prefix: orders.\n    message_retention: {min: 8d, default: 10d}\n"
	loosePolicy := "consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 10d}\n"
	write(strictPolicy + identity(`"orders.*"`))
	p := servetest.Start(t, bin, t.TempDir(), nil, "--config", path)
	p.WaitLog(t, "serving")

	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "bearer orders-token")
	n := 0
	claim := func(consumer string, retention time.Duration) error {
		n++
		_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: "m-" + string(rune('a'+n)), Retention: durationpb.New(retention)})
		return err
	}
	// policyLoose: a 2h retention is allowed; wider: the identity may use
	// billing.worker.
	state := func() (policyLoose, wider bool) {
		err := claim("orders.inbox", 2*time.Hour)
		if status.Code(err) != codes.InvalidArgument {
			require.NoError(t, err)
			policyLoose = true
		}
		err = claim("billing.worker", 9*24*time.Hour)
		if status.Code(err) != codes.PermissionDenied {
			require.NoError(t, err)
			wider = true
		}
		return policyLoose, wider
	}
	loose, wider := state()
	require.False(t, loose)
	require.False(t, wider)

	// Valid policy, invalid access (a rate limit of zero): refused whole.
	write(loosePolicy + identity(`"orders.*", "billing.*"`) + "rate_limits:\n  - {consumers: [\"orders.*\"], rate: 0}\n")
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	line := p.WaitLog(t, "config reload rejected; the policy and access in force stay")
	require.Contains(t, line["error"], "rate_limits[0]: rate must be a positive number")
	loose, wider = state()
	require.False(t, loose, "the policy part of a refused file must not apply")
	require.False(t, wider, "the access part of a refused file must not apply")

	// Invalid policy, valid access: refused whole too.
	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 30m}\n" + identity(`"orders.*", "billing.*"`))
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	line = p.WaitLog(t, "config reload rejected; the policy and access in force stay")
	require.Contains(t, line["error"], "message_retention.default 30m0s is below message_retention.min 1h0m0s")
	loose, wider = state()
	require.False(t, loose)
	require.False(t, wider)

	// Both valid: both apply.
	write(loosePolicy + identity(`"orders.*", "billing.*"`))
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	p.WaitLog(t, "config reloaded")
	loose, wider = state()
	require.True(t, loose)
	require.True(t, wider)

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait())
}

// TestServeReloadsConfigWhenItChanges: serve takes a config file changed
// on disk without a signal, written in place and by a ConfigMap's ..data
// symlink swap; keeps the policy in force when the new file is broken;
// and says which file is live in its logs and on /metrics.
func TestServeReloadsConfigWhenItChanges(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	// A ConfigMap's layout: idemreg.yaml -> ..data/idemreg.yaml, and
	// ..data -> the directory of the current version.
	n := 0
	publish := func(doc string) {
		n++
		version := filepath.Join(dir, fmt.Sprintf("..2026_12_04_v%d", n))
		require.NoError(t, os.Mkdir(version, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(version, "idemreg.yaml"), []byte(doc), 0o644))
		require.NoError(t, os.Symlink(filepath.Base(version), filepath.Join(dir, "..data_tmp")))
		require.NoError(t, os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")))
	}
	retention := func(min string) string {
		return "consumers:\n  - prefix: orders.\n    message_retention: {min: " + min + ", default: 10d}\n"
	}
	publish(retention("8d"))
	path := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.Symlink(filepath.Join("..data", "idemreg.yaml"), path))
	metricsAddr := servetest.FreeAddr(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--config", path, "--config-poll", "50ms", "--metrics-listen", metricsAddr)
	loaded := p.WaitLog(t, "config loaded")
	p.WaitLog(t, "serving")

	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	key := 0
	twoHours := func() error { // a retention the strict policy refuses
		key++
		_, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "orders.inbox", Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: fmt.Sprint("m-", key), Retention: durationpb.New(2 * time.Hour)})
		return err
	}
	configInfo := func() string {
		res, err := http.Get("http://" + metricsAddr + "/metrics")
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		m := regexp.MustCompile(`(?m)^idemreg_config_info\{.*version="([0-9a-f]+)".*\} 1$`).FindStringSubmatch(string(b))
		require.NotNil(t, m, "idemreg_config_info on /metrics:\n%s", b)
		return m[1]
	}
	require.Equal(t, codes.InvalidArgument, status.Code(twoHours()))
	require.Equal(t, loaded["version"], configInfo())

	// A ConfigMap update: no signal.
	publish(retention("1h"))
	line := p.WaitLog(t, "config reloaded")
	require.Equal(t, "file changed", line["trigger"])
	require.NoError(t, twoHours(), "the new policy applies")
	require.Equal(t, line["version"], configInfo())
	require.NotEqual(t, loaded["version"], line["version"])

	// A broken file: logged, and the policy in force stays.
	publish(retention("1h") + "    lease: {default: [\n")
	rejected := p.WaitLog(t, "config reload rejected; the policy and access in force stay")
	require.Equal(t, line["version"], rejected["version"], "the log says which version stays live")
	require.NoError(t, twoHours())
	require.Equal(t, line["version"], configInfo())

	// Written in place, as an editor would: taken too, and SIGHUP still
	// reloads.
	target, err := filepath.EvalSymlinks(path)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(target, []byte(retention("8d")), 0o644))
	p.WaitLog(t, "config reloaded")
	require.Equal(t, codes.InvalidArgument, status.Code(twoHours()))
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGHUP))
	require.Equal(t, "SIGHUP", p.WaitLog(t, "config reloaded")["trigger"])

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait())
}

// TestServeDoesNotTakeAHalfWrittenConfig: a config file rewritten in place
// by a writer that pauses, longer than --config-poll, after a first part
// that parses (one identity of two) is not taken half-written: the second
// identity is never refused meanwhile, the first reload serve logs is the
// whole file's, and the whole file applies once it has settled (issue 35,
// weakness 6).
func TestServeDoesNotTakeAHalfWrittenConfig(t *testing.T) {
	bin := servetest.Binary(t)
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	identity := func(name, consumers string) string {
		return "  - {name: " + name + ", token_hashes: [\"" + access.HashToken(name+"-token") + "\"], consumers: [" + consumers + "]}\n"
	}
	require.NoError(t, os.WriteFile(path, []byte("identities:\n"+identity("orders", `"orders.*"`)+identity("billing", `"billing.*"`)), 0o600))
	const poll = 200 * time.Millisecond
	p := servetest.Start(t, bin, t.TempDir(), nil, "--config", path, "--config-poll", poll.String())
	p.WaitLog(t, "serving")

	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	billing := metadata.AppendToOutgoingContext(t.Context(), "authorization", "bearer billing-token")
	var n atomic.Int64
	claim := func(consumer string) error {
		_, err := c.Claim(billing, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: fmt.Sprint("m-", n.Add(1))})
		return err
	}
	require.NoError(t, claim("billing.inbox"))
	require.Equal(t, codes.PermissionDenied, status.Code(claim("refunds.inbox")))

	// billing calls all along: none may be refused.
	stop := make(chan struct{})
	probed := make(chan error, 1)
	go func() {
		var calls int
		for {
			select {
			case <-stop:
				if calls == 0 {
					probed <- errors.New("no call made while the file was rewritten")
				}
				probed <- nil
				return
			default:
			}
			if err := claim("billing.inbox"); err != nil {
				probed <- fmt.Errorf("call %d while the file was rewritten: %w", calls, err)
				return
			}
			calls++
		}
	}()

	// The rewrite grants billing refunds.*; its first part, which parses,
	// ends before billing.
	first := "identities:\n" + identity("orders", `"orders.*"`)
	second := identity("billing", `"billing.*", "refunds.*"`)
	sum := sha256.Sum256([]byte(first + second))
	whole := hex.EncodeToString(sum[:6])
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	require.NoError(t, err)
	_, err = f.WriteString(first)
	require.NoError(t, err)
	time.Sleep(poll + poll/4) // a pause longer than a poll: at least one poll reads the first part alone
	_, err = f.WriteString(second)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	line := p.WaitLog(t, "config reloaded")
	close(stop)
	require.NoError(t, <-probed)
	require.Equal(t, whole, line["version"], "the first reload must be the whole file's, not its first part's")
	require.Equal(t, []any{"orders", "billing"}, line["identities"])
	require.NoError(t, claim("refunds.inbox"), "the whole file applies once settled")

	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait())
}
