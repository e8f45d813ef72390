package console_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"html/template"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// The identities of the tests: oncall administers billing.*, shipping
// administers shipping.* only, reader may only use billing.* through
// RegistryService.
const (
	oncallToken   = "oncall-token-7f3a"
	shippingToken = "shipping-token-5d20"
	readerToken   = "reader-token-91bc"
	consumer      = "billing.payment-worker"
)

// testIdentities are the identities of setup's server with identities.
var testIdentities = func() *access.Set {
	set, err := access.Parse([]byte(`identities:
  - name: oncall
    token_hashes: ["` + access.HashToken(oncallToken) + `"]
    consumers: ["billing.*"]
    admin: ["billing.*"]
  - name: shipping
    token_hashes: ["` + access.HashToken(shippingToken) + `"]
    consumers: ["shipping.*"]
    admin: ["shipping.*"]
  - name: reader
    token_hashes: ["` + access.HashToken(readerToken) + `"]
    consumers: ["billing.*"]
`))
	if err != nil {
		panic(err)
	}
	return set
}()

// do sends req with c and returns the status and body.
func do(t *testing.T, c *http.Client, req *http.Request) (int, string) {
	t.Helper()
	res, err := c.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

// syncBuffer collects the server's logs from its goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// lines decodes the JSON log lines whose msg is msg.
func (s *syncBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(s.b.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// env is a real server with identities and a console in front of it.
type env struct {
	conn    *grpc.ClientConn
	console *httptest.Server
	logs    *syncBuffer
	// consoleLogs are the console's own lines (sign-ins, refusals).
	consoleLogs *syncBuffer
}

// setup starts the server and the console; opts change the console's
// Config.
func setup(t *testing.T, withIdentities bool, opts ...func(*console.Config)) *env {
	t.Helper()
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	set := access.Open()
	if withIdentities {
		set = testIdentities
	}
	logs := &syncBuffer{}
	// The server knows the response types the console is given, as serve
	// wires both.
	var given console.Config
	for _, o := range opts {
		o(&given)
	}
	addr, grpcSrv := servertest.Serve(t, store, server.Config{
		Access:      set,
		Logger:      slog.New(slog.NewJSONHandler(logs, nil)),
		ResultTypes: given.Types,
	})
	conn := servertest.Dial(t, addr)
	// As serve wires it (cmd/idemreg/console.go): the server's in-process
	// connection.
	in, err := grpcSrv.InProcess()
	require.NoError(t, err)
	t.Cleanup(func() { _ = in.Close() })
	consoleLogs := &syncBuffer{}
	cfg := console.Config{Conn: in, ActAs: server.ActAs, SweepLag: console.SweepLagFrom(store), Logger: slog.New(slog.NewJSONHandler(consoleLogs, nil))}
	if withIdentities {
		cfg.SignIn = console.SignInWith(func() *access.Set { return set })
	}
	for _, o := range opts {
		o(&cfg)
	}
	h, err := console.New(cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{conn: conn, console: srv, logs: logs, consoleLogs: consoleLogs}
}

// browser is an HTTP client with its own cookies.
func (e *env) browser(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &http.Client{Jar: jar}
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	res, err := c.Get(u)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

func post(t *testing.T, c *http.Client, u string, form url.Values) (int, string) {
	t.Helper()
	res, err := c.PostForm(u, form)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

func (e *env) signIn(t *testing.T, token string) *http.Client {
	t.Helper()
	c := e.browser(t)
	code, body := post(t, c, e.console.URL+"/signin", url.Values{"token": {token}})
	require.Equal(t, http.StatusOK, code, body)
	return c
}

// claim claims key as holder with the oncall token and returns the answer.
func (e *env) claim(t *testing.T, key, holder string) *idemregv1.ClaimResponse {
	t.Helper()
	return e.claimIn(t, consumer, key, holder)
}

// claimIn is claim for another consumer.
func (e *env) claimIn(t *testing.T, consumer, key, holder string) *idemregv1.ClaimResponse {
	t.Helper()
	res, err := e.registry().Claim(oncall(t), &idemregv1.ClaimRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Holder: holder,
	})
	require.NoError(t, err)
	return res
}

func (e *env) registry() idemregv1.RegistryServiceClient {
	return idemregv1.NewRegistryServiceClient(e.conn)
}

// oncall is the context of a call as the oncall identity.
func oncall(t *testing.T) context.Context {
	return metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+oncallToken)
}

func (e *env) inspect(t *testing.T, key string) *idemregv1.Record {
	t.Helper()
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+oncallToken)
	res, err := idemregv1.NewAdminServiceClient(e.conn).InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
	require.NoError(t, err)
	return res.GetRecord()
}

func recordURL(base, key string) string {
	return base + "/record?" + url.Values{"consumer": {consumer}, "kind": {"KIND_OPERATION"}, "key": {key}}.Encode()
}

var hidden = regexp.MustCompile(`<input type="hidden" name="(\w+)" value="([^"]*)">`)

// formFields returns the hidden fields of the first form with id in body.
func formFields(t *testing.T, body, id string) url.Values {
	t.Helper()
	i := strings.Index(body, `id="`+id+`"`)
	require.GreaterOrEqual(t, i, 0, "no form %s in %s", id, body)
	form := body[i:]
	form = form[:strings.Index(form, "</form>")]
	v := url.Values{}
	for _, m := range hidden.FindAllStringSubmatch(form, -1) {
		v.Set(m[1], htmlUnescape(m[2]))
	}
	return v
}

func htmlUnescape(s string) string {
	return strings.NewReplacer("&lt;", "<", "&gt;", ">", "&#34;", `"`, "&#39;", "'", "&amp;", "&", "&#43;", "+").Replace(s)
}

func TestConsoleSignIn(t *testing.T) {
	e := setup(t, true)
	c := e.browser(t)

	// Not signed in: every page sends the browser to the sign-in form.
	code, body := get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`)

	code, body = post(t, c, e.console.URL+"/signin", url.Values{"token": {"not-a-token"}})
	require.Equal(t, http.StatusUnauthorized, code)
	require.Contains(t, body, "unknown token")
	code, body = get(t, c, recordURL(e.console.URL, "k"))
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`, "a refused sign-in opens no session")

	c = e.signIn(t, oncallToken)
	code, body = get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
	require.Contains(t, body, `<dd id="store-health">SERVING</dd>`)
	require.NotContains(t, body, oncallToken, "the token never goes back to the browser")
	u, err := url.Parse(e.console.URL)
	require.NoError(t, err)
	for _, ck := range c.Jar.Cookies(u) {
		require.NotContains(t, ck.Value, oncallToken)
	}

	// Signing out ends the session on the server.
	csrf := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(body)[1]
	code, body = post(t, c, e.console.URL+"/signout", url.Values{"csrf": {csrf}})
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`)
}

// TestConsoleSignInNeedsAdminGrant: a token whose
// identity administers no consumer is refused at sign-in, with a message
// that says why, and opens no session; on main it signed in.
func TestConsoleSignInNeedsAdminGrant(t *testing.T) {
	e := setup(t, true)
	c := e.browser(t)
	code, body := post(t, c, e.console.URL+"/signin", url.Values{"token": {readerToken}})
	require.Equal(t, http.StatusForbidden, code, body)
	require.Contains(t, body, "identity reader administers no consumer")
	code, body = get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`, "a refused sign-in opens no session")
	lines := e.consoleLogs.lines(t, "console sign-in refused")
	require.Len(t, lines, 1)
	require.Equal(t, "reader", lines[0]["identity"])
	require.Equal(t, "no admin grant", lines[0]["reason"])
}

// TestConsoleSessionFlood: one identity's sign-ins
// beyond its bound end its own oldest sessions, so 1,030 sign-ins (more
// than DefaultMaxSessions) leave another identity's sign-in working; the
// flooding identity's newest sessions still work and its oldest has
// ended. On main the 1,025th sign-in and every one after it, the other
// identity's included, got "too many console sessions" for 8 hours.
func TestConsoleSessionFlood(t *testing.T) {
	e := setup(t, true)
	first := e.signIn(t, shippingToken)
	var last *http.Client
	for range console.DefaultMaxSessions + 5 {
		last = e.browser(t)
		code, body := post(t, last, e.console.URL+"/signin", url.Values{"token": {shippingToken}})
		require.Equal(t, http.StatusOK, code, body)
	}
	c := e.signIn(t, oncallToken)
	code, body := get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<b id="identity">oncall</b>`)

	code, body = get(t, last, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<b id="identity">shipping</b>`, "the flooding identity's newest session works")
	code, body = get(t, first, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`, "its oldest session has ended")
}

func TestConsoleSignInCookie(t *testing.T) {
	e := setup(t, true)
	res, err := http.PostForm(e.console.URL+"/signin", url.Values{"token": {oncallToken}})
	require.NoError(t, err)
	_ = res.Body.Close()
	// The redirect's response set the cookie; look at it on the first hop.
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err = c.PostForm(e.console.URL+"/signin", url.Values{"token": {oncallToken}})
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusSeeOther, res.StatusCode)
	cookies := res.Cookies()
	require.Len(t, cookies, 1)
	require.True(t, cookies[0].HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, cookies[0].SameSite)
	require.NotContains(t, cookies[0].Value, oncallToken)
}

func TestConsolePermissionDenied(t *testing.T) {
	e := setup(t, true)
	e.claim(t, "charge:order-1", "worker-1")
	c := e.signIn(t, shippingToken)
	code, body := get(t, c, recordURL(e.console.URL, "charge:order-1"))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "Permission denied")
	require.Contains(t, body, "admin grant")
	require.NotContains(t, body, `id="record"`)
	require.NotContains(t, body, "worker-1")
}

func TestConsoleNotFound(t *testing.T) {
	e := setup(t, true)
	c := e.signIn(t, oncallToken)
	code, body := get(t, c, recordURL(e.console.URL, "never-claimed"))
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, "No record")
}

// TestConsoleEscapes: a key, a holder, a result type and result bytes that
// are markup are shown as text.
func TestConsoleEscapes(t *testing.T) {
	e := setup(t, true)
	const key, holder = `<script>alert("key")</script>`, `<script>alert('holder')</script>`
	claimed := e.claim(t, key, holder)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+oncallToken)
	_, err := idemregv1.NewRegistryServiceClient(e.conn).Complete(ctx, &idemregv1.CompleteRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(),
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "<script>type</script>", Data: []byte("<img src=x onerror=alert(1)>")}}},
	})
	require.NoError(t, err)

	c := e.signIn(t, oncallToken)
	code, body := get(t, c, recordURL(e.console.URL, key))
	require.Equal(t, http.StatusOK, code, body)
	require.NotContains(t, body, "<script>alert")
	require.NotContains(t, body, "<script>type")
	require.NotContains(t, body, "<img")
	require.Contains(t, body, `<dd id="key">&lt;script&gt;alert(&#34;key&#34;)&lt;/script&gt;</dd>`)
	require.Contains(t, body, `<dd id="holder">&lt;script&gt;alert(&#39;holder&#39;)&lt;/script&gt;</dd>`)
	require.Contains(t, body, `<code id="result-type">&lt;script&gt;type&lt;/script&gt;</code>`)
	require.Contains(t, body, `<pre id="result-preview">3c696d67`, "result bytes shown as hex")
	require.Equal(t, 1, strings.Count(body, "<script"), "only the console's own script tag")
}

// TestConsoleCSRF: an invalidation without the session's CSRF token, with
// a wrong one, or from another site is refused and changes nothing.
func TestConsoleCSRF(t *testing.T) {
	e := setup(t, true)
	claimed := e.claim(t, "charge:order-2", "worker-2")
	c := e.signIn(t, oncallToken)
	_, body := get(t, c, recordURL(e.console.URL, "charge:order-2"))
	good := formFields(t, body, "invalidate-form")
	require.NotEmpty(t, good.Get("csrf"))
	good.Set("reason", "stuck, OPS-2")
	good.Set("confirm", "yes")

	other := e.signIn(t, oncallToken)
	_, otherBody := get(t, other, recordURL(e.console.URL, "charge:order-2"))
	otherCSRF := formFields(t, otherBody, "invalidate-form").Get("csrf")

	requireForgeriesRefused(t, e, c, "/invalidate", good, otherCSRF)

	rec := e.inspect(t, "charge:order-2")
	require.Equal(t, claimed.GetToken(), rec.GetToken(), "nothing changed")
	require.Equal(t, "worker-2", rec.GetHolder())
	for _, l := range e.logs.lines(t, "admin action") {
		require.NotEqual(t, "invalidate", l["action"], "no refused form reached InvalidateRecord")
	}
}

// TestConsoleInvalidate: the invalidation asks for a reason and a
// confirmation, then invalidates the record as the signed-in identity, in
// the audit log with its reason.
func TestConsoleInvalidate(t *testing.T) {
	e := setup(t, true)
	claimed := e.claim(t, "charge:order-3", "worker-3")
	c := e.signIn(t, oncallToken)
	_, body := get(t, c, recordURL(e.console.URL, "charge:order-3"))
	require.Contains(t, body, `<dd id="state">in progress</dd>`)
	form := formFields(t, body, "invalidate-form")

	code, body := post(t, c, e.console.URL+"/invalidate", form)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, body, "A reason is required")

	form.Set("reason", "worker-3 crashed with a long lease, OPS-3")
	code, body = post(t, c, e.console.URL+"/invalidate", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "Confirm the invalidation")
	require.Equal(t, claimed.GetToken(), e.inspect(t, "charge:order-3").GetToken(), "nothing changes before the confirmation")

	confirm := formFields(t, body, "confirm-form")
	require.Equal(t, "yes", confirm.Get("confirm"))
	code, body = post(t, c, e.console.URL+"/invalidate", confirm)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="notice">Invalidated`)

	rec := e.inspect(t, "charge:order-3")
	require.Greater(t, rec.GetToken(), claimed.GetToken())
	require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, rec.GetState())
	require.Contains(t, body, `<dd id="token">`+strconv.FormatInt(rec.GetToken(), 10)+`</dd>`)

	var invalidations []map[string]any
	for _, l := range e.logs.lines(t, "admin action") {
		if l["action"] == "invalidate" {
			invalidations = append(invalidations, l)
		}
	}
	require.Len(t, invalidations, 1)
	require.Equal(t, "oncall", invalidations[0]["identity"])
	require.Equal(t, "worker-3 crashed with a long lease, OPS-3", invalidations[0]["reason"])
	require.Equal(t, "ok", invalidations[0]["result"])

	// The confirmation names the token inspected: sent again, the record
	// has changed since and is not invalidated twice.
	code, body = post(t, c, e.console.URL+"/invalidate", confirm)
	require.Equal(t, http.StatusConflict, code, body)
	require.Equal(t, rec.GetToken(), e.inspect(t, "charge:order-3").GetToken())
}

// TestConsoleOpenServer: a server without identities has no sign-in; the
// console still protects its actions with a CSRF token.
func TestConsoleOpenServer(t *testing.T) {
	e := setup(t, false)
	e.claim(t, "charge:order-4", "worker-4")
	c := e.browser(t)
	code, body := get(t, c, recordURL(e.console.URL, "charge:order-4"))
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<dd id="holder">worker-4</dd>`)
	require.NotContains(t, body, "Sign out")
	_, home := get(t, c, e.console.URL+"/")
	require.Contains(t, home, `<dd id="parked">none, for the consumers you administer</dd>`, "an open server lets the console count")
	form := formFields(t, body, "invalidate-form")
	form.Set("reason", "test")
	form.Set("confirm", "yes")
	form.Del("csrf")
	code, _ = post(t, c, e.console.URL+"/invalidate", form)
	require.Equal(t, http.StatusForbidden, code)
}

// park claims key of consumer as holder and parks it with reason, as a
// holder whose outcome is unknown does; it returns the claim.
func (e *env) park(t *testing.T, consumer, key, holder, reason string) *idemregv1.ClaimResponse {
	t.Helper()
	claimed := e.claimIn(t, consumer, key, holder)
	_, err := e.registry().Park(oncall(t), &idemregv1.ParkRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(), Reason: reason,
	})
	require.NoError(t, err)
	return claimed
}

// retried claims key as first, releases it, and claims it again as second:
// attempt 2, with the first attempt in the record's history.
func (e *env) retried(t *testing.T, key, first, second string) *idemregv1.ClaimResponse {
	t.Helper()
	claimed := e.claim(t, key, first)
	_, err := e.registry().Release(oncall(t), &idemregv1.ReleaseRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(),
	})
	require.NoError(t, err)
	again := e.claim(t, key, second)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
	require.Equal(t, int64(2), again.GetRecord().GetAttempt())
	return again
}

// auditActions counts the server's audit lines by action.
func (e *env) auditActions(t *testing.T) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, l := range e.logs.lines(t, "admin action") {
		out[l["action"].(string)]++
	}
	return out
}

var (
	listedKey = regexp.MustCompile(`<a class="key" href="([^"]*)">([^<]*)</a>`)
	nextPage  = regexp.MustCompile(`<a href="([^"]*)" id="next-page">`)
)

// listed returns the keys a records page lists, as text, with their links.
func listed(body string) (keys, links []string) {
	for _, m := range listedKey.FindAllStringSubmatch(body, -1) {
		links = append(links, htmlUnescape(m[1]))
		keys = append(keys, htmlUnescape(m[2]))
	}
	return keys, links
}

// TestConsoleStatusPanel: the home page shows the sweeper's lag as the
// hook reports it, and the parked records per consumer the identity
// administers, as CountParked counts them.
func TestConsoleStatusPanel(t *testing.T) {
	t.Run("counts and lag", func(t *testing.T) {
		e := setup(t, true, func(c *console.Config) {
			c.SweepLag = func(context.Context) (time.Duration, bool, error) { return 90 * time.Second, true, nil }
		})
		e.park(t, consumer, "charge:1", "w1", "timeout after send")
		e.park(t, consumer, "charge:2", "w2", "timeout after send")
		e.park(t, "billing.refunds", "refund:<b>1</b>", "w3", "provider down")
		e.claim(t, "charge:3", "w4") // in progress: not counted
		c := e.signIn(t, oncallToken)
		code, body := get(t, c, e.console.URL+"/")
		require.Equal(t, http.StatusOK, code, body)
		require.Contains(t, body, `<dd id="sweep-lag">1m30s: the oldest expired record has waited this long to be deleted</dd>`)
		require.Contains(t, body, `<dd id="parked">3 in all`)
		require.Contains(t, body, `<td class="consumer">billing.payment-worker</td><td class="count"><a href="/records?consumer=billing.payment-worker&amp;match=exact&amp;state=STATE_PARKED">2</a></td>`)
		require.Contains(t, body, `<td class="consumer">billing.refunds</td>`)
		require.Less(t, strings.Index(body, "billing.payment-worker</td>"), strings.Index(body, "billing.refunds</td>"), "by name")
	})
	t.Run("no hook", func(t *testing.T) {
		e := setup(t, true, func(c *console.Config) { c.SweepLag = nil })
		c := e.signIn(t, oncallToken)
		_, body := get(t, c, e.console.URL+"/")
		require.Contains(t, body, `<dd id="sweep-lag">not available`)
		require.Contains(t, body, `<dd id="parked">none, for the consumers you administer</dd>`)
	})
	for name, tc := range map[string]struct {
		lag  time.Duration
		ok   bool
		err  error
		want string
	}{
		"empty store":  {want: "none: the store holds no record"},
		"none expired": {ok: true, want: "none: no stored record has expired yet"},
		"days":         {lag: 50*time.Hour + 3*time.Minute, ok: true, want: "2d2h3m0s: the oldest"},
		"store error":  {err: errors.New("pq: secret driver text"), want: "unknown: the store did not answer"},
	} {
		t.Run(name, func(t *testing.T) {
			e := setup(t, false, func(c *console.Config) {
				c.SweepLag = func(context.Context) (time.Duration, bool, error) { return tc.lag, tc.ok, tc.err }
			})
			_, body := get(t, e.browser(t), e.console.URL+"/")
			require.Contains(t, body, `<dd id="sweep-lag">`+tc.want)
			require.NotContains(t, body, "secret driver text", "the store's error goes to the log only")
		})
	}
	t.Run("from the store", func(t *testing.T) {
		e := setup(t, true)
		c := e.signIn(t, oncallToken)
		_, body := get(t, c, e.console.URL+"/")
		require.Contains(t, body, `<dd id="sweep-lag">none: the store holds no record</dd>`)
		e.claim(t, "charge:1", "w1")
		_, body = get(t, c, e.console.URL+"/")
		require.Contains(t, body, `<dd id="sweep-lag">none: no stored record has expired yet</dd>`)
	})
	t.Run("another team's admin", func(t *testing.T) {
		e := setup(t, true)
		e.park(t, consumer, "charge:1", "w1", "timeout after send")
		c := e.signIn(t, shippingToken)
		code, body := get(t, c, e.console.URL+"/")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, `<dd id="parked">none, for the consumers you administer</dd>`)
		require.NotContains(t, body, consumer)
	})
}

// TestConsoleRecords: the records page lists parked records by default,
// escaped, each linked to its record page, pages through ListRecords'
// page tokens, and filters by consumer, state, attempt and age.
func TestConsoleRecords(t *testing.T) {
	e := setup(t, true)
	const hostileKey, hostileReason = `charge:<script>alert("key")</script>`, `<img src=x onerror=alert(1)>`
	e.park(t, consumer, hostileKey, "<b>worker</b>", hostileReason)
	e.park(t, consumer, "charge:b", "w-b", "timeout after send")
	retried := e.retried(t, "charge:c", "w-c1", "w-c2")
	_, err := e.registry().Park(oncall(t), &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:c",
		Token: retried.GetToken(), ClaimSecret: retried.GetClaimSecret(), Reason: "second try lost its answer"})
	require.NoError(t, err)
	e.park(t, "billing.refunds", "refund:a", "w-r", "provider down")
	e.claim(t, "charge:in-progress", "w-p")
	c := e.signIn(t, oncallToken)

	code, body := get(t, c, e.console.URL+"/records")
	require.Equal(t, http.StatusOK, code, body)
	keys, links := listed(body)
	require.Equal(t, []string{"charge:<script>alert(\"key\")</script>", "charge:b", "charge:c", "refund:a"}, keys, "parked only, every consumer administered, in key order")
	require.NotContains(t, body, "<script>alert")
	require.NotContains(t, body, "<img")
	require.Contains(t, body, `<td class="park-reason" data-label="Park reason">&lt;img src=x onerror=alert(1)&gt;</td>`)
	require.Contains(t, body, `<td class="holder" data-label="Holder">&lt;b&gt;worker&lt;/b&gt;</td>`)
	require.Equal(t, 1, strings.Count(body, "<script"), "only the console's own script tag")
	require.Contains(t, body, `<td class="attempt" data-label="Attempt">2</td>`)
	require.Contains(t, body, "1, last taken over (its lease ended)", "charge:c's earlier attempt")
	require.Contains(t, body, `id="list-end"`)

	// The link opens the record page of exactly that key.
	u, err := url.Parse(links[0])
	require.NoError(t, err)
	require.Equal(t, "/record", u.Path)
	require.Equal(t, hostileKey, u.Query().Get("key"))
	code, body = get(t, c, e.console.URL+links[0])
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<dd id="state">parked</dd>`)
	require.Contains(t, body, `<dd id="park-reason">&lt;img src=x onerror=alert(1)&gt;</dd>`)

	// One record a page: every parked record exactly once, by page tokens.
	var paged []string
	next := "/records?size=1"
	for pages := 0; next != ""; pages++ {
		require.Less(t, pages, 10, "the listing ends")
		code, body = get(t, c, e.console.URL+next)
		require.Equal(t, http.StatusOK, code, body)
		k, _ := listed(body)
		paged = append(paged, k...)
		next = ""
		if m := nextPage.FindStringSubmatch(body); m != nil {
			next = htmlUnescape(m[1])
			require.Contains(t, next, "size=1", "the next page keeps the filters")
			require.Contains(t, next, "state=STATE_PARKED")
		}
		if pages > 0 {
			require.Contains(t, body, `id="first-page"`)
		}
	}
	require.Equal(t, keys, paged)

	for _, tc := range []struct {
		name  string
		query url.Values
		want  []string
	}{
		{name: "one consumer exactly", query: url.Values{"consumer": {"billing.refunds"}, "match": {"exact"}}, want: []string{"refund:a"}},
		{name: "consumer prefix", query: url.Values{"consumer": {"billing.pay"}}, want: []string{hostileKey, "charge:b", "charge:c"}},
		{name: "min attempt", query: url.Values{"min_attempt": {"2"}}, want: []string{"charge:c"}},
		{name: "in progress", query: url.Values{"state": {"STATE_IN_PROGRESS"}}, want: []string{"charge:in-progress"}},
		{name: "in progress, older than an hour", query: url.Values{"state": {"STATE_IN_PROGRESS"}, "older_than": {"1h"}}, want: nil},
		{name: "any state", query: url.Values{"state": {"any"}, "consumer": {"billing.refunds"}}, want: []string{"refund:a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, c, e.console.URL+"/records?"+tc.query.Encode())
			require.Equal(t, http.StatusOK, code, body)
			got, _ := listed(body)
			require.Equal(t, tc.want, got)
			if tc.want == nil {
				require.Contains(t, body, `id="no-records"`)
			}
		})
	}
	for name, q := range map[string]url.Values{
		"bad state":          {"state": {"STATE_<b>"}},
		"negative attempt":   {"min_attempt": {"-1"}},
		"bad duration":       {"older_than": {"soon"}},
		"page too large":     {"size": {"501"}},
		"exact without name": {"match": {"exact"}},
	} {
		t.Run(name, func(t *testing.T) {
			code, body := get(t, c, e.console.URL+"/records?"+q.Encode())
			require.Equal(t, http.StatusBadRequest, code, body)
			require.Contains(t, body, "Invalid filter")
			require.NotContains(t, body, "<b>")
		})
	}
	t.Run("garbled page token", func(t *testing.T) {
		code, body := get(t, c, e.console.URL+"/records?page=AAAA")
		require.Equal(t, http.StatusBadRequest, code, body)
		require.Contains(t, body, "Invalid request: ")
	})
	t.Run("another team's admin", func(t *testing.T) {
		code, body := get(t, e.signIn(t, shippingToken), e.console.URL+"/records")
		require.Equal(t, http.StatusOK, code, body)
		require.NotContains(t, body, "charge:b")
	})
}

// TestConsoleRecordHistory: the record page shows the record's earlier
// attempts, escaped.
func TestConsoleRecordHistory(t *testing.T) {
	e := setup(t, true)
	e.retried(t, "charge:h", `<script>alert("first")</script>`, "second")
	c := e.signIn(t, oncallToken)
	code, body := get(t, c, recordURL(e.console.URL, "charge:h"))
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<dd id="attempt">2</dd>`)
	require.Contains(t, body, `<table id="history">`)
	require.Contains(t, body, `<td class="holder">&lt;script&gt;alert(&#34;first&#34;)&lt;/script&gt;</td>`)
	require.Contains(t, body, `<td class="end">taken over (its lease ended)</td>`)
	require.Equal(t, 1, strings.Count(body, "<script"))

	e.claim(t, "charge:once", "w")
	_, body = get(t, c, recordURL(e.console.URL, "charge:once"))
	require.Contains(t, body, `id="no-history"`)
}

// resolveForm is the record page's resolve form of key, filled in with
// fields.
func resolveForm(t *testing.T, e *env, c *http.Client, key string, fields url.Values) url.Values {
	t.Helper()
	code, body := get(t, c, recordURL(e.console.URL, key))
	require.Equal(t, http.StatusOK, code, body)
	form := formFields(t, body, "resolve-form")
	for k, v := range fields {
		form[k] = v
	}
	return form
}

// confirmResolve posts form without confirm=yes and returns the
// confirmation page's form.
func confirmResolve(t *testing.T, e *env, c *http.Client, form url.Values) (url.Values, string) {
	t.Helper()
	code, body := post(t, c, e.console.URL+"/resolve", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "Confirm the resolution")
	confirm := formFields(t, body, "resolve-confirm-form")
	require.Equal(t, "yes", confirm.Get("confirm"))
	return confirm, body
}

// TestConsoleResolveComplete: a parked record completed with a result
// through the confirmation; the next Claim replays that result, and the
// record page shows the ended attempt with the operator's reason.
func TestConsoleResolveComplete(t *testing.T) {
	e := setup(t, true)
	parked := e.park(t, consumer, "charge:42", "worker-42", "provider timed out after send")
	c := e.signIn(t, oncallToken)
	const reason = "provider says charge ch_1 succeeded, OPS-42"
	form := resolveForm(t, e, c, "charge:42", url.Values{
		"reason": {reason}, "action": {"complete"}, "outcome": {"response"},
		"type": {"example.v1.ChargeResponse"}, "encoding": {"text"}, "data": {"{\"charge\":\r\n\"ch_1\"}"},
	})
	confirm, body := confirmResolve(t, e, c, form)
	require.Contains(t, body, `<code id="confirm-result-type">example.v1.ChargeResponse</code>, 18 bytes`, "CRLF sent as LF")
	require.Contains(t, body, `<pre id="confirm-result-preview">`+hex.EncodeToString([]byte("{\"charge\":\n\"ch_1\"}"))+`</pre>`)
	require.Contains(t, body, `<dd id="confirm-now">parked, attempt 1, holder worker-42; parked: provider timed out after send</dd>`)
	require.Contains(t, body, "every later Claim of the key replays this result")
	require.Equal(t, "base64", confirm.Get("encoding"), "the confirmation carries the bytes exactly")
	require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:42").GetState(), "nothing changes before the confirmation")

	code, body := post(t, c, e.console.URL+"/resolve", confirm)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="notice">Resolved with your result`)
	require.Contains(t, body, `<dd id="state">completed</dd>`)
	require.Contains(t, body, `<td class="end">resolved by an operator: completed</td>`)
	require.Contains(t, body, `<td class="note">`+reason+`</td>`)
	require.Contains(t, body, `<td class="park-reason">provider timed out after send</td>`)
	require.NotContains(t, body, `id="action-release"`, "a completed record is not released, only its result repaired")

	again := e.claim(t, "charge:42", "worker-43")
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, again.GetOutcome())
	resp := again.GetRecord().GetResult().GetResponse()
	require.Equal(t, "example.v1.ChargeResponse", resp.GetType())
	require.Equal(t, []byte("{\"charge\":\n\"ch_1\"}"), resp.GetData())
	require.Greater(t, again.GetRecord().GetToken(), parked.GetToken())

	var resolved []map[string]any
	for _, l := range e.logs.lines(t, "admin action") {
		if l["action"] == "resolve" {
			resolved = append(resolved, l)
		}
	}
	require.Len(t, resolved, 1)
	require.Equal(t, "oncall", resolved[0]["identity"])
	require.Equal(t, reason, resolved[0]["reason"])
	require.Equal(t, "ok", resolved[0]["result"])
}

// TestConsoleResolveOutcomes: a release acquires as attempt 1 at the next
// Claim; a failure and a base64 response are replayed as given.
func TestConsoleResolveOutcomes(t *testing.T) {
	e := setup(t, true)
	c := e.signIn(t, oncallToken)
	t.Run("release", func(t *testing.T) {
		e.retried(t, "charge:r", "w1", "w2") // stuck in progress at attempt 2, lease live
		confirm, body := confirmResolve(t, e, c, resolveForm(t, e, c, "charge:r", url.Values{"reason": {"w2 is gone, OPS-9"}, "action": {"release"}}))
		require.Contains(t, body, "the holder, whose lease is still live, is fenced out")
		code, body := post(t, c, e.console.URL+"/resolve", confirm)
		require.Equal(t, http.StatusOK, code, body)
		require.Contains(t, body, `id="notice">Resolved by a release`)
		require.Contains(t, body, `<dd id="attempt">0</dd>`)
		again := e.claim(t, "charge:r", "w3")
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
		require.Equal(t, int64(1), again.GetRecord().GetAttempt())
	})
	t.Run("failure", func(t *testing.T) {
		e.park(t, consumer, "charge:f", "w", "unknown")
		confirm, body := confirmResolve(t, e, c, resolveForm(t, e, c, "charge:f", url.Values{
			"reason": {"card declined at the provider"}, "action": {"complete"}, "outcome": {"failure"},
			"code": {"9"}, "message": {"card declined"}, "type": {"ignored"}, "data": {"ignored"},
		}))
		require.Contains(t, body, `<code id="confirm-result-type">FailedPrecondition</code>`)
		require.Contains(t, body, `<pre id="confirm-result-message">card declined</pre>`)
		require.Empty(t, confirm.Get("type"), "the confirmation carries only what the resolution uses")
		code, body := post(t, c, e.console.URL+"/resolve", confirm)
		require.Equal(t, http.StatusOK, code, body)
		again := e.claim(t, "charge:f", "w2")
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, again.GetOutcome())
		require.Equal(t, int32(9), again.GetRecord().GetResult().GetFailure().GetCode())
		require.Equal(t, "card declined", again.GetRecord().GetResult().GetFailure().GetMessage())
	})
	t.Run("base64", func(t *testing.T) {
		e.park(t, consumer, "charge:b64", "w", "unknown")
		data := []byte{0, 1, 2, 0xff, '<', '>'}
		confirm, _ := confirmResolve(t, e, c, resolveForm(t, e, c, "charge:b64", url.Values{
			"reason": {"by hand"}, "action": {"complete"}, "outcome": {"response"}, "type": {"bytes"},
			"encoding": {"base64"}, "data": {base64.StdEncoding.EncodeToString(data)[:4] + "\n" + base64.StdEncoding.EncodeToString(data)[4:]},
		}))
		code, body := post(t, c, e.console.URL+"/resolve", confirm)
		require.Equal(t, http.StatusOK, code, body)
		require.Contains(t, body, `<pre id="result-preview">000102ff3c3e</pre>`)
		require.Equal(t, data, e.claim(t, "charge:b64", "w2").GetRecord().GetResult().GetResponse().GetData())
	})
}

// TestConsoleResolveSomeoneActedFirst: two operators confirm the same
// resolution; the second is refused with LEASE_LOST, shown as "someone
// acted first", and nothing of theirs is stored.
func TestConsoleResolveSomeoneActedFirst(t *testing.T) {
	e := setup(t, true)
	e.park(t, consumer, "charge:race", "w", "unknown")
	alice, bob := e.signIn(t, oncallToken), e.signIn(t, oncallToken)
	aliceConfirm, _ := confirmResolve(t, e, alice, resolveForm(t, e, alice, "charge:race", url.Values{"reason": {"alice: release"}, "action": {"release"}}))
	bobForm := resolveForm(t, e, bob, "charge:race", url.Values{
		"reason": {"bob: complete"}, "action": {"complete"}, "outcome": {"response"}, "type": {"t"}, "encoding": {"text"}, "data": {"bob's"},
	})
	bobConfirm, _ := confirmResolve(t, e, bob, bobForm)

	code, body := post(t, alice, e.console.URL+"/resolve", aliceConfirm)
	require.Equal(t, http.StatusOK, code, body)
	after := e.inspect(t, "charge:race")

	code, body = post(t, bob, e.console.URL+"/resolve", bobConfirm)
	require.Equal(t, http.StatusConflict, code, body)
	require.Contains(t, body, `id="error">Someone acted first`)
	require.Contains(t, body, `<dd id="token">`+strconv.FormatInt(after.GetToken(), 10)+`</dd>`, "the page shows the record as it is now")
	rec := e.inspect(t, "charge:race")
	require.Equal(t, after.GetToken(), rec.GetToken())
	require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, rec.GetState(), "alice's release stands")
	require.Nil(t, rec.GetResult())

	// A form from before alice acted is stopped at its confirmation step.
	code, body = post(t, bob, e.console.URL+"/resolve", bobForm)
	require.Equal(t, http.StatusConflict, code, body)
	require.Contains(t, body, "Someone acted first")
	require.NotContains(t, body, "Confirm the resolution")
	require.Contains(t, body, `>bob&#39;s</textarea>`, "bob's input is kept in the form")

	var results []string
	for _, l := range e.logs.lines(t, "admin action") {
		if l["action"] == "resolve" {
			results = append(results, l["result"].(string))
		}
	}
	require.Equal(t, []string{"ok", "LEASE_LOST"}, results)
}

// TestConsoleResolveCSRF: a resolution without the session's CSRF token,
// with a wrong one, or from another site is refused and changes nothing.
func TestConsoleResolveCSRF(t *testing.T) {
	e := setup(t, true)
	e.park(t, consumer, "charge:csrf", "w", "unknown")
	before := e.inspect(t, "charge:csrf")
	c := e.signIn(t, oncallToken)
	good, _ := confirmResolve(t, e, c, resolveForm(t, e, c, "charge:csrf", url.Values{"reason": {"OPS-1"}, "action": {"release"}}))
	_, otherBody := get(t, e.signIn(t, oncallToken), recordURL(e.console.URL, "charge:csrf"))
	otherCSRF := formFields(t, otherBody, "resolve-form").Get("csrf")

	requireForgeriesRefused(t, e, c, "/resolve", good, otherCSRF)
	t.Run("too large", func(t *testing.T) {
		form := url.Values{}
		for k, v := range good {
			form[k] = v
		}
		form.Set("data", strings.Repeat("A", 70<<10))
		code, body := post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusRequestEntityTooLarge, code, body)
	})

	rec := e.inspect(t, "charge:csrf")
	require.Equal(t, before.GetToken(), rec.GetToken(), "nothing changed")
	require.Equal(t, idemregv1.State_STATE_PARKED, rec.GetState())
	require.Zero(t, e.auditActions(t)["resolve"], "no refused form reached ResolveRecord")
}

// TestConsoleResolveEscapes: a key, a reason, a result type and a failure
// message that are markup are shown as text on the confirmation and in the
// history.
func TestConsoleResolveEscapes(t *testing.T) {
	e := setup(t, true)
	const key = `<script>alert("k")</script>`
	const reason, typ, message = `<img src=x onerror=alert("r")>`, `<script>alert("t")</script>`, `<iframe src=javascript:alert(1)>`
	e.park(t, consumer, key, "w", `<svg onload=alert("p")>`)
	c := e.signIn(t, oncallToken)
	_, body := get(t, c, recordURL(e.console.URL, key))
	require.Contains(t, body, `<dd id="park-reason">&lt;svg onload=alert(&#34;p&#34;)&gt;</dd>`)

	_, body = confirmResolve(t, e, c, resolveForm(t, e, c, key, url.Values{
		"reason": {reason}, "action": {"complete"}, "outcome": {"response"}, "type": {typ}, "encoding": {"text"}, "data": {"<b>data</b>"},
	}))
	require.Contains(t, body, `<dd id="confirm-key">&lt;script&gt;alert(&#34;k&#34;)&lt;/script&gt;</dd>`)
	require.Contains(t, body, `<dd id="confirm-reason">&lt;img src=x onerror=alert(&#34;r&#34;)&gt;</dd>`)
	require.Contains(t, body, `<code id="confirm-result-type">&lt;script&gt;alert(&#34;t&#34;)&lt;/script&gt;</code>`)
	require.Contains(t, body, `<pre id="confirm-result-preview">3c623e`, "data as hex")
	require.NotContains(t, body, "<img")
	require.NotContains(t, body, "<b>data")
	require.Equal(t, 1, strings.Count(body, "<script"))

	e.park(t, consumer, key+"2", "w", "unknown")
	confirm, body := confirmResolve(t, e, c, resolveForm(t, e, c, key+"2", url.Values{
		"reason": {reason}, "action": {"complete"}, "outcome": {"failure"}, "code": {"3"}, "message": {message},
	}))
	require.Contains(t, body, `<pre id="confirm-result-message">&lt;iframe src=javascript:alert(1)&gt;</pre>`)
	code, body := post(t, c, e.console.URL+"/resolve", confirm)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<td class="note">&lt;img src=x onerror=alert(&#34;r&#34;)&gt;</td>`)
	require.Contains(t, body, `<pre id="result-message">&lt;iframe src=javascript:alert(1)&gt;</pre>`)
	require.NotContains(t, body, "<iframe")
	require.NotContains(t, body, "<img")
	require.Equal(t, 1, strings.Count(body, "<script"))
}

// TestConsoleResolveRefusesBadForms: a form the console cannot turn into a
// ResolveRecord is refused before any confirmation, with the record page,
// the operator's input kept, and nothing changed.
func TestConsoleResolveRefusesBadForms(t *testing.T) {
	e := setup(t, true)
	e.park(t, consumer, "charge:bad", "w", "unknown")
	before := e.inspect(t, "charge:bad")
	c := e.signIn(t, oncallToken)
	complete := url.Values{"reason": {"by hand"}, "action": {"complete"}, "outcome": {"response"}, "type": {"kept-type"}, "encoding": {"text"}, "data": {"x"}}
	with := func(k, v string) url.Values {
		out := url.Values{}
		for kk, vv := range complete {
			out[kk] = vv
		}
		out.Set(k, v)
		return out
	}
	for _, tc := range []struct {
		name   string
		fields url.Values
		want   string
	}{
		{"no reason", with("reason", ""), "a reason is required"},
		{"reason too long", with("reason", strings.Repeat("r", 257)), "the reason must be at most 256 bytes"},
		{"reason not printable", with("reason", "a\x07b"), "the reason must be printable"},
		{"no action", with("action", ""), "choose what to do"},
		{"no outcome", with("outcome", "both"), "choose the result"},
		{"bad base64", with("encoding", "base64"), "not valid base64"},
		{"no encoding", with("encoding", ""), "choose how the response's data is written"},
		{"data too large", with("data", strings.Repeat("x", 8<<10+1)), "at most 8192 bytes here"},
		{"type not printable", with("type", "a\nb"), "the response's type must be printable"},
		{"failure code OK", with("outcome", "failure"), "a failure needs a gRPC code other than OK"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			form := resolveForm(t, e, c, "charge:bad", tc.fields)
			if tc.name == "failure code OK" {
				form.Set("code", "0")
			}
			code, body := post(t, c, e.console.URL+"/resolve", form)
			require.Equal(t, http.StatusBadRequest, code, body)
			require.Contains(t, body, `id="error">Not resolved: `)
			require.Contains(t, body, htmlEscape(tc.want))
			require.Contains(t, body, `id="resolve-form"`)
			require.Contains(t, body, `value="`+htmlEscape(form.Get("type"))+`"`, "the input is kept")
			form.Set("confirm", "yes") // confirming does not skip the checks
			code, _ = post(t, c, e.console.URL+"/resolve", form)
			require.Equal(t, http.StatusBadRequest, code)
		})
	}
	t.Run("no token", func(t *testing.T) {
		form := resolveForm(t, e, c, "charge:bad", complete)
		form.Del("token")
		code, _ := post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusBadRequest, code)
	})
	t.Run("completed record", func(t *testing.T) {
		claimed := e.claim(t, "charge:done", "w")
		_, err := e.registry().Complete(oncall(t), &idemregv1.CompleteRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:done",
			Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(),
			Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "t"}}}})
		require.NoError(t, err)
		_, body := get(t, c, recordURL(e.console.URL, "charge:done"))
		require.Contains(t, body, "Repair the result")
		require.NotContains(t, body, `id="action-release"`)
		form := formFields(t, body, "resolve-form")
		for k, v := range complete {
			form[k] = v
		}
		form.Set("action", "release")
		code, body := post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusConflict, code, body)
		require.Contains(t, body, "a completed record is not released")
		form.Set("confirm", "yes")
		code, body = post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusConflict, code, body, "the registry refuses it too")
		require.Equal(t, "t", e.inspect(t, "charge:done").GetResult().GetResponse().GetType(), "nothing changed")

		// A result repairs the stored one.
		form.Set("action", "complete")
		form.Del("confirm")
		code, body = post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusOK, code, body)
		form.Set("confirm", "yes")
		code, _ = post(t, c, e.console.URL+"/resolve", form)
		require.Equal(t, http.StatusOK, code)
		rec := e.inspect(t, "charge:done")
		require.Equal(t, idemregv1.State_STATE_COMPLETED, rec.GetState())
		require.Equal(t, "kept-type", rec.GetResult().GetResponse().GetType(), "the result was repaired")
	})
	rec := e.inspect(t, "charge:bad")
	require.Equal(t, before.GetToken(), rec.GetToken())
	require.Equal(t, idemregv1.State_STATE_PARKED, rec.GetState())
}

func htmlEscape(s string) string { return template.HTMLEscapeString(s) }

// expiries is a store's oldest expiry, for SweepLagFrom.
type expiries struct {
	oldest, now time.Time
	ok          bool
	err         error
}

func (x expiries) OldestExpiry(context.Context) (time.Time, time.Time, bool, error) {
	return x.oldest, x.now, x.ok, x.err
}

func TestSweepLagFrom(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		store   expiries
		lag     time.Duration
		ok      bool
		wantErr bool
	}{
		{name: "expired a minute ago", store: expiries{oldest: now.Add(-time.Minute), now: now, ok: true}, lag: time.Minute, ok: true},
		{name: "not expired yet", store: expiries{oldest: now.Add(time.Hour), now: now, ok: true}, lag: 0, ok: true},
		{name: "empty store", store: expiries{now: now}, ok: false},
		{name: "store error", store: expiries{err: errors.New("unavailable")}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lag, ok, err := console.SweepLagFrom(tc.store)(t.Context())
			if tc.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.lag, lag)
		})
	}
}

// requireForgeriesRefused posts good, a valid confirmed form of path, with
// its CSRF token missing, empty, wrong or another session's (otherCSRF),
// marked cross-site by the browser, and without a session: every one is
// refused with 403 and nothing is done.
func requireForgeriesRefused(t *testing.T, e *env, c *http.Client, path string, good url.Values, otherCSRF string) {
	t.Helper()
	require.NotEqual(t, good.Get("csrf"), otherCSRF, "each session has its own CSRF token")
	for name, csrf := range map[string][]string{
		"missing":           nil,
		"empty":             {""},
		"wrong":             {"AAAA" + good.Get("csrf")[4:]},
		"another session's": {otherCSRF},
	} {
		t.Run(name, func(t *testing.T) {
			form := url.Values{}
			for k, v := range good {
				form[k] = v
			}
			form["csrf"] = csrf
			code, body := post(t, c, e.console.URL+path, form)
			require.Equal(t, http.StatusForbidden, code, body)
			require.Contains(t, body, "CSRF")
		})
	}
	for name, header := range map[string][2]string{
		"cross-site origin":       {"Origin", "https://evil.example"},
		"cross-site fetch":        {"Sec-Fetch-Site", "cross-site"},
		"same-site, other origin": {"Sec-Fetch-Site", "same-site"},
	} {
		t.Run(name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.console.URL+path, strings.NewReader(good.Encode()))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set(header[0], header[1])
			res, err := c.Do(req)
			require.NoError(t, err)
			_ = res.Body.Close()
			require.Equal(t, http.StatusForbidden, res.StatusCode)
		})
	}
	t.Run("no session", func(t *testing.T) {
		code, _ := post(t, e.browser(t), e.console.URL+path, good)
		require.Equal(t, http.StatusForbidden, code)
	})
}
