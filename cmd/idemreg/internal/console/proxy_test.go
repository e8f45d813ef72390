package console_test

import (
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/server/access"
)

const (
	proxyHeader = "X-Forwarded-Email"
	// proxySecret is the secret the test's proxy sends.
	proxySecret = "proxy-secret-0123456789abcdef0123456789abcdef"
)

// withProxy turns proxy sign-in on, believing the header with the proxy's
// secret, and only from trusted when it names addresses (the test's
// requests come from 127.0.0.1).
func withProxy(trusted ...netip.Prefix) func(*console.Config) {
	return func(cfg *console.Config) {
		users, err := console.ParseUserMap([]string{"alice@example.com=oncall", "*@shipping.example.com=shipping", "bob@example.com=reader", "carol@example.com=ghost"})
		if err != nil {
			panic(err)
		}
		cfg.Proxy = &console.ProxySignIn{Header: proxyHeader, Secret: []byte(proxySecret), Trusted: trusted, Identity: console.ProxyIdentityWith(func() *access.Set { return testIdentities }, users)}
	}
}

// getAs GETs u as the proxy does: its header naming user, and its secret.
func getAs(t *testing.T, c *http.Client, u, user string) (int, string) {
	t.Helper()
	return getWithSecret(t, c, u, user, proxySecret)
}

// getWithSecret GETs u with the proxy's header naming user and, unless
// empty, secret in the proxy's secret header.
func getWithSecret(t *testing.T, c *http.Client, u, user string, secret ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, u, nil)
	require.NoError(t, err)
	req.Header.Set(proxyHeader, user)
	for _, s := range secret {
		req.Header.Add(console.ProxySecretHeader, s)
	}
	return do(t, c, req)
}

// TestConsoleProxySignIn: a request the trusted proxy names a user in is
// signed in as the identity the user maps to, and acts as it (its grants
// decide, and the audit log names it); the session lasts only while the
// proxy vouches for it; a user mapped to no identity with an admin grant
// is refused.
func TestConsoleProxySignIn(t *testing.T) {
	e := setup(t, true, withProxy())
	claimed := e.claim(t, "charge:1", "worker-1")
	c := e.browser(t)

	code, body := getAs(t, c, e.console.URL+"/", "Alice@Example.com")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
	require.NotContains(t, body, "Sign out", "the proxy signs the next request in again")
	code, body = getAs(t, c, recordURL(e.console.URL, "charge:1"), "alice@example.com")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<dd id="holder">worker-1</dd>`)

	// An action, as the mapped identity.
	form := formFields(t, body, "invalidate-form")
	form.Set("reason", "proxy sign-in test")
	form.Set("confirm", "yes")
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.console.URL+"/invalidate", strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set(proxyHeader, "alice@example.com")
	req.Header.Set(console.ProxySecretHeader, proxySecret)
	code, body = do(t, c, req)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "Invalidated")
	require.Greater(t, e.inspect(t, "charge:1").GetToken(), claimed.GetToken())
	var audited bool
	for _, l := range e.logs.lines(t, "admin action") {
		audited = audited || (l["action"] == "invalidate" && l["identity"] == "oncall" && l["reason"] == "proxy sign-in test")
	}
	require.True(t, audited, "the audit log names the mapped identity")

	// The sign-in page, through the proxy, leads to the pages.
	code, body = getAs(t, e.browser(t), e.console.URL+"/signin", "alice@example.com")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">oncall</b>`)

	// The cookie alone, without the proxy's header, is no sign-in.
	code, body = get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`, "back to the sign-in page")

	// A domain mapping; its identity's grants decide.
	code, body = getAs(t, e.browser(t), recordURL(e.console.URL, "charge:1"), "dan@shipping.example.com")
	require.Equal(t, http.StatusForbidden, code, body)
	require.Contains(t, body, `<b id="identity">shipping</b>`)
	require.Contains(t, body, "Permission denied")

	for user, want := range map[string]string{
		"mallory@example.com": "maps to no identity",
		"bob@example.com":     "administers no consumer",
		"carol@example.com":   "which --config does not name",
	} {
		code, body = getAs(t, e.browser(t), e.console.URL+"/", user)
		require.Equal(t, http.StatusForbidden, code, user)
		require.Contains(t, body, want, user)
		require.NotContains(t, body, `id="identity"`, user)
	}
}

// TestConsoleProxyNeedsItsSecret: from loopback, where kubectl
// port-forward and ssh -L arrive, the proxy's header without the proxy's
// secret, with a wrong one or with two, is refused, not believed, even for
// a browser that has a session; the refusal is logged without the secret
// sent. With the secret the same request signs in (issue 35, weakness 4).
func TestConsoleProxyNeedsItsSecret(t *testing.T) {
	e := setup(t, true, withProxy())
	c := e.signIn(t, oncallToken)
	wrong := "wrong-secret-0123456789abcdef0123456789abcdef"
	for name, secret := range map[string][]string{
		"none":             nil,
		"empty":            {""},
		"wrong":            {wrong},
		"a prefix":         {proxySecret[:len(proxySecret)-1]},
		"right, and wrong": {proxySecret, wrong},
	} {
		t.Run(name, func(t *testing.T) {
			code, body := getWithSecret(t, c, e.console.URL+"/", "alice@example.com", secret...)
			require.Equal(t, http.StatusForbidden, code, body)
			require.Contains(t, body, "is only believed from the console&#39;s proxy, which sends its secret in "+console.ProxySecretHeader)
			require.NotContains(t, body, `id="identity"`)
		})
	}
	var logged int
	for _, l := range e.consoleLogs.lines(t, "console sign-in refused") {
		if l["reason"] == "proxy header without the proxy's secret" {
			logged++
		}
	}
	require.Equal(t, 5, logged)
	require.NotContains(t, e.consoleLogs.String(), wrong, "the secret sent is never logged")
	require.NotContains(t, e.consoleLogs.String(), proxySecret)

	// Without the header the token's session goes on.
	code, body := get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
	// With the secret: signed in as the user's identity.
	code, body = getAs(t, e.browser(t), e.console.URL+"/", "alice@example.com")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
}

// TestConsoleProxyHeaderUntrusted: the header from an address that is not
// the proxy's is refused, not believed, its secret notwithstanding, even
// for a browser that has a session.
func TestConsoleProxyHeaderUntrusted(t *testing.T) {
	e := setup(t, true, withProxy(netip.MustParsePrefix("10.1.2.3/32")))
	c := e.signIn(t, oncallToken)
	code, body := getAs(t, c, e.console.URL+"/", "alice@example.com")
	require.Equal(t, http.StatusForbidden, code, body)
	require.Contains(t, body, "is only believed from the console")
	require.NotContains(t, body, `id="identity"`)
	var logged bool
	for _, l := range e.consoleLogs.lines(t, "console sign-in refused") {
		logged = logged || l["reason"] == "proxy header from an untrusted address"
	}
	require.True(t, logged)
	// Without the header the token's session goes on.
	code, body = get(t, c, e.console.URL+"/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<b id="identity">oncall</b>`)
}

// TestConsoleProxyHeaderIgnoredWhenOff: without proxy sign-in configured,
// the header means nothing.
func TestConsoleProxyHeaderIgnoredWhenOff(t *testing.T) {
	e := setup(t, true)
	code, body := getAs(t, e.browser(t), e.console.URL+"/", "alice@example.com")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `name="token"`, "the sign-in page, not a session")
	require.NotContains(t, body, `id="identity"`)
}

// TestConsoleCrossOriginSignIn: the sign-in form, which has no CSRF token
// yet, is refused from another origin (net/http.CrossOriginProtection);
// from the same origin it signs in.
func TestConsoleCrossOriginSignIn(t *testing.T) {
	e := setup(t, true)
	u, err := url.Parse(e.console.URL)
	require.NoError(t, err)
	for name, h := range map[string][2]string{
		"other origin":    {"Origin", "https://evil.example"},
		"null origin":     {"Origin", "null"},
		"cross-site":      {"Sec-Fetch-Site", "cross-site"},
		"same-site":       {"Sec-Fetch-Site", "same-site"},
		"same origin":     {"Origin", "http://" + u.Host},
		"same-origin tag": {"Sec-Fetch-Site", "same-origin"},
	} {
		t.Run(name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.console.URL+"/signin", strings.NewReader(url.Values{"token": {oncallToken}}.Encode()))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set(h[0], h[1])
			code, body := do(t, e.browser(t), req)
			if strings.HasPrefix(name, "same") && name != "same-site" {
				require.Equal(t, http.StatusOK, code, body)
				require.Contains(t, body, `<b id="identity">oncall</b>`)
				return
			}
			require.Equal(t, http.StatusForbidden, code, body)
			require.Contains(t, body, "cross-origin request refused")
		})
	}
}

func TestParseUserMap(t *testing.T) {
	m, err := console.ParseUserMap([]string{"alice@example.com=oncall", "*@example.com=team", "*=viewer"})
	require.NoError(t, err)
	for user, want := range map[string]string{"alice@example.com": "oncall", "ALICE@example.com": "oncall", "bob@example.com": "team", "eve@other.example": "viewer", "noat": "viewer"} {
		got, ok := m.Lookup(user)
		require.True(t, ok, user)
		require.Equal(t, want, got, user)
	}
	m, err = console.ParseUserMap([]string{"alice@example.com=oncall"})
	require.NoError(t, err)
	_, ok := m.Lookup("bob@example.com")
	require.False(t, ok)
	for _, bad := range [][]string{nil, {"alice"}, {"=x"}, {"a*b@example.com=x"}, {"alice@example.com="}} {
		_, err := console.ParseUserMap(bad)
		require.Error(t, err, "%q", bad)
	}
}
