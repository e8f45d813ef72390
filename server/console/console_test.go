package console_test

import (
	"bytes"
	"encoding/json"
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

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/console"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// The identities of the tests: oncall administers billing.*, reader may
// only use billing.* through RegistryService.
const (
	oncallToken = "oncall-token-7f3a"
	readerToken = "reader-token-91bc"
	consumer    = "billing.payment-worker"
)

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
}

func setup(t *testing.T, withIdentities bool) *env {
	t.Helper()
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	set := access.Open()
	if withIdentities {
		set, err = access.Parse([]byte(`identities:
  - name: oncall
    token_hashes: ["` + access.HashToken(oncallToken) + `"]
    consumers: ["billing.*"]
    admin: ["billing.*"]
  - name: reader
    token_hashes: ["` + access.HashToken(readerToken) + `"]
    consumers: ["billing.*"]
`))
		require.NoError(t, err)
	}
	logs := &syncBuffer{}
	addr, _ := servertest.Serve(t, store, server.Config{
		Access: access.Static(set),
		Logger: slog.New(slog.NewJSONHandler(logs, nil)),
	})
	conn := servertest.Dial(t, addr)
	cfg := console.Config{Conn: conn}
	if withIdentities {
		cfg.SignIn = func(token string) (string, bool) {
			id, ok := set.ByToken(token)
			if !ok {
				return "", false
			}
			return id.Name, true
		}
	}
	h, err := console.New(cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{conn: conn, console: srv, logs: logs}
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
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+oncallToken)
	res, err := idemregv1.NewRegistryServiceClient(e.conn).Claim(ctx, &idemregv1.ClaimRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Holder: holder,
	})
	require.NoError(t, err)
	return res
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
	c := e.signIn(t, readerToken)
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
			code, body := post(t, c, e.console.URL+"/invalidate", form)
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
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.console.URL+"/invalidate", strings.NewReader(good.Encode()))
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
		code, _ := post(t, e.browser(t), e.console.URL+"/invalidate", good)
		require.Equal(t, http.StatusForbidden, code)
	})

	rec := e.inspect(t, "charge:order-2")
	require.Equal(t, claimed.GetToken(), rec.GetToken(), "nothing changed")
	require.Equal(t, "worker-2", rec.GetHolder())
	for _, l := range e.logs.lines(t, "admin action") {
		require.Equal(t, "inspect", l["action"], "no refused form reached InvalidateRecord")
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
	require.Contains(t, body, `<dd id="state">STATE_IN_PROGRESS</dd>`)
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
	form := formFields(t, body, "invalidate-form")
	form.Set("reason", "test")
	form.Set("confirm", "yes")
	form.Del("csrf")
	code, _ = post(t, c, e.console.URL+"/invalidate", form)
	require.Equal(t, http.StatusForbidden, code)
}
