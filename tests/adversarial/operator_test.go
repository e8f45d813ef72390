package adversarial

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// The attacks of this file are on what an operator configures, each on a
// serve of its own (the suite's has no console, polls its config file
// every 10 s, and holds its data directory): the console's proxy sign-in,
// the config file's reload, and the claim key's rotation.

// operatorServe is one `idemreg serve` of this file's cases, on a data
// directory of its own, until stop or the test's end.
type operatorServe struct {
	addr string
	cmd  *exec.Cmd
	// lines are serve's JSON log lines, as they come.
	lines chan map[string]any
	done  <-chan struct{}
}

func startOperatorServe(t *testing.T, dataDir string, args ...string) *operatorServe {
	t.Helper()
	o := &operatorServe{lines: make(chan map[string]any, 4096)}
	p := servetest.StartWith(t, servetest.Options{
		Args: append([]string{"--data-dir", dataDir, "--sweep-interval", "0"}, args...),
		Observe: func(text string, line map[string]any) {
			if line == nil {
				line = map[string]any{"msg": "unstructured: " + text}
			}
			select {
			case o.lines <- line:
			default: // nobody waits for this one
			}
		}})
	o.addr, o.cmd, o.done = p.Addr, p.Cmd, p.Exited()
	t.Cleanup(o.stop)
	o.waitLog(t, "serving")
	return o
}

// waitLog waits for serve's next line with msg.
func (o *operatorServe) waitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	timeout := time.After(60 * time.Second)
	for {
		select {
		case line := <-o.lines:
			if line["msg"] == msg {
				return line
			}
		case <-o.done:
			t.Fatalf("idemreg serve exited before logging %q", msg)
		case <-timeout:
			t.Fatalf("idemreg serve did not log %q", msg)
		}
	}
}

func (o *operatorServe) stop() {
	if o.cmd.ProcessState != nil {
		return
	}
	_ = o.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-o.done:
	case <-time.After(30 * time.Second):
		_ = o.cmd.Process.Kill()
	}
	_ = o.cmd.Wait()
}

// consoleProxyPortForward (issue 35, weakness 4). The console signs
// operators in from a trusted proxy's header. An operator who reaches the
// console by kubectl port-forward or ssh -L arrives on loopback, as a
// sidecar proxy does, and sends that header naming the admin's user.
// Bound: the header is believed only with the proxy's secret
// (--console-proxy-secret-file, sent in X-Idemreg-Proxy-Secret): from
// loopback without it, or with a wrong one, the request is refused 403
// and signs nobody in; with it, the proxy's user is signed in as the
// identity it maps to; the secret is never logged. serve refuses to start
// a proxy sign-in without a secret.
func consoleProxyPortForward(t *testing.T, _ *suite) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(configDoc), 0o600))
	secret := "b1946ac92492d2347c6235b4d2611184b1946ac92492d2347c6235b4d2611184"
	secretFile := filepath.Join(dir, "proxy-secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(secret+"\n"), 0o600))
	proxyArgs := []string{"--config", cfg, "--console-proxy-header", "X-Forwarded-Email", "--console-proxy-user", "*@example.com=alpha"}

	// No secret: serve does not start (and, if it did, is stopped after
	// 30 s, failing the case rather than hanging it).
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, servetest.Binary(t), append([]string{"serve", "--listen", servetest.FreeAddr(t), "--data-dir", filepath.Join(dir, "refused"), "--console-listen", servetest.FreeAddr(t)}, proxyArgs...)...).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "--console-proxy-header needs --console-proxy-secret-file")

	consoleAddr := servetest.FreeAddr(t)
	o := startOperatorServe(t, filepath.Join(dir, "data"), append(proxyArgs, "--console-listen", consoleAddr, "--console-proxy-secret-file", secretFile)...)
	get := func(header ...string) (int, string) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+consoleAddr+"/", nil)
		require.NoError(t, err)
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Add(header[i], header[i+1])
		}
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		body, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(body)
	}
	const user = "X-Forwarded-Email"
	for name, header := range map[string][]string{
		"no secret":       {user, "admin@example.com"},
		"empty secret":    {user, "admin@example.com", "X-Idemreg-Proxy-Secret", ""},
		"wrong secret":    {user, "admin@example.com", "X-Idemreg-Proxy-Secret", strings.Repeat("0", len(secret))},
		"secret's prefix": {user, "admin@example.com", "X-Idemreg-Proxy-Secret", secret[:len(secret)-1]},
		"two secrets":     {user, "admin@example.com", "X-Idemreg-Proxy-Secret", secret, "X-Idemreg-Proxy-Secret", "x"},
	} {
		code, body := get(header...)
		require.Equal(t, http.StatusForbidden, code, "%s: %s", name, body)
		require.NotContains(t, body, `id="identity"`, name)
	}
	code, body := get(user, "admin@example.com", "X-Idemreg-Proxy-Secret", secret)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">alpha</b>`)
	o.stop()
	for line := range drain(o.lines) {
		b, _ := json.Marshal(line)
		require.NotContains(t, string(b), secret, "the secret is never logged")
	}
}

// drain is what is left in lines, once serve has stopped writing.
func drain(lines chan map[string]any) chan map[string]any {
	out := make(chan map[string]any, len(lines))
	for {
		select {
		case l := <-lines:
			out <- l
		default:
			close(out)
			return out
		}
	}
}

// configWrittenInPlace (issue 35, weakness 6). An operator's tool rewrites
// the config file in place in two writes, pausing between them longer
// than --config-poll; the first part parses and ends before the second
// identity. Bound: a changed file is taken only once it has read the same
// for two poll intervals, so the half file is never taken: the second
// identity's calls all along the rewrite succeed, the first reload is the
// whole file's, and the whole file applies once it has settled.
func configWrittenInPlace(t *testing.T, _ *suite) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemreg.yaml")
	identity := func(name, consumers string) string {
		return "  - {name: " + name + ", token_hashes: [\"" + access.HashToken(name+"-token-0123456789") + "\"], consumers: [" + consumers + "]}\n"
	}
	require.NoError(t, os.WriteFile(cfg, []byte("identities:\n"+identity("alpha", `"alpha.*"`)+identity("beta", `"beta.*"`)), 0o600))
	const poll = 200 * time.Millisecond
	o := startOperatorServe(t, filepath.Join(dir, "data"), "--config", cfg, "--config-poll", poll.String())
	c := registry(servetest.Dial(t, o.addr))
	ctx := bearer(t.Context(), "beta-token-0123456789")
	var n atomic.Int64
	call := func(ctx context.Context, consumer string) error {
		_, err := c.Claim(ctx, claim(consumer, fmt.Sprint("rewrite-", n.Add(1))))
		return err
	}
	require.Equal(t, codes.PermissionDenied, status.Code(call(ctx, "gamma.inbox")))

	stop := make(chan struct{})
	refused := make(chan error, 1)
	go func() {
		defer close(refused)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := call(ctx, "beta.inbox"); err != nil {
				refused <- err
				return
			}
		}
	}()
	f, err := os.OpenFile(cfg, os.O_WRONLY|os.O_TRUNC, 0)
	require.NoError(t, err)
	_, err = f.WriteString("identities:\n" + identity("alpha", `"alpha.*"`))
	require.NoError(t, err)
	time.Sleep(poll + poll/4)
	_, err = f.WriteString(identity("beta", `"beta.*", "gamma.*"`))
	require.NoError(t, err)
	require.NoError(t, f.Close())

	line := o.waitLog(t, "config reloaded")
	close(stop)
	require.NoError(t, <-refused, "beta was refused while the file was rewritten")
	require.Equal(t, []any{"alpha", "beta"}, line["identities"], "the first reload must be the whole file")
	require.NoError(t, call(ctx, "gamma.inbox"), "the whole file applies once settled")
}

// shortClaimKeyRotation (issue 35, weakness 7). `rotate-claim-key
// --activate-after 1s --grace 1s` would retire the key a held claim's
// secret was issued under a second after the new one is current, and its
// Complete would be refused CLAIM_SECRET_INVALID. Bound: rotate-claim-key
// refuses an activation below serve's claim key refresh (30s) or a grace
// below --max-lease (1h), naming the flag, and adds no generation;
// --allow-short-rotation takes them; with the defaults a claim held
// across the rotation completes.
func shortClaimKeyRotation(t *testing.T, _ *suite) {
	data := filepath.Join(t.TempDir(), "data")
	o := startOperatorServe(t, data)
	c := registry(servetest.Dial(t, o.addr))
	held, err := c.Claim(t.Context(), claim("alpha.rotation", "held"))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, held.GetOutcome())
	o.stop() // the embedded store is rotated with serve stopped

	rotate := func(args ...string) (string, error) {
		out, err := exec.Command(servetest.Binary(t), append([]string{"rotate-claim-key", "--data-dir", data}, args...)...).CombinedOutput()
		return string(out), err
	}
	out, err := rotate("--activate-after", "1s", "--grace", "1s")
	require.Error(t, err, out)
	require.Contains(t, out, "--activate-after 1s is shorter than serve's claim key refresh (30s)")
	require.Contains(t, out, "--grace 1s is shorter than --max-lease (1h0m0s)")
	require.NotContains(t, out, "added")
	out, err = rotate()
	require.NoError(t, err, out)
	require.Contains(t, out, "claim key generation 2 added", "the defaults pass")

	o = startOperatorServe(t, data)
	c = registry(servetest.Dial(t, o.addr))
	_, err = c.Complete(t.Context(), &idemregv1.CompleteRequest{Consumer: "alpha.rotation", Kind: op, Key: "held",
		Token: held.GetToken(), ClaimSecret: held.GetClaimSecret(), Result: response("done")})
	require.NoError(t, err, "a claim held across a rotation with the defaults completes")
	o.stop()

	out, err = rotate("--activate-after", "1s", "--grace", "1s", "--allow-short-rotation")
	require.NoError(t, err, out)
	require.Contains(t, out, "claim key generation 3 added")
}
