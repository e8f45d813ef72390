package console

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"

	"github.com/idemreg/idemreg/server/access"
)

// ProxySignIn signs operators in from a header that a trusted reverse
// proxy sets after authenticating them (oauth2-proxy's X-Forwarded-Email
// or X-Auth-Request-User, an identity-aware proxy's user header). The
// header is believed only from a request that carries the proxy's secret
// in ProxySecretHeader: a request that carries the user's header without
// it is refused, as a forgery. A source address proves nothing by itself:
// kubectl port-forward and ssh -L, the ways to reach a console on
// loopback, arrive on loopback too.
type ProxySignIn struct {
	// Header names the header, as the proxy sets it.
	Header string
	// Secret is what the proxy sends in ProxySecretHeader on every
	// request: at least MinProxySecretSize bytes. Never logged.
	Secret []byte
	// Trusted, when not empty, are the addresses the proxy connects from:
	// a request from any other is refused, its secret notwithstanding.
	Trusted []netip.Prefix
	// Identity maps the header's user to the identity of the config file
	// the console acts as, or an error saying why the user is refused
	// (ProxyIdentityWith).
	Identity func(user string) (identity string, err error)
}

// ProxySecretHeader is the header the trusted proxy sends its secret in
// (nginx's proxy_set_header, Envoy's request_headers_to_add, oauth2-proxy's
// injectRequestHeaders).
const ProxySecretHeader = "X-Idemreg-Proxy-Secret"

// MinProxySecretSize is the shortest proxy secret taken: 32 bytes, as
// `openssl rand -hex 32` writes twice that, so that it cannot be guessed
// through the console's answers.
const MinProxySecretSize = 32

// UserMap maps a proxy's users to identities: an exact user
// ("alice@example.com"), a domain ("*@example.com") or anyone ("*"), in
// that order of precedence.
type UserMap struct {
	exact, domain map[string]string
	anyone        string
}

// ParseUserMap reads "USER=IDENTITY" entries.
func ParseUserMap(entries []string) (UserMap, error) {
	m := UserMap{exact: map[string]string{}, domain: map[string]string{}}
	var errs []error
	for _, e := range entries {
		user, identity, ok := strings.Cut(strings.TrimSpace(e), "=")
		user, identity = strings.TrimSpace(user), strings.TrimSpace(identity)
		switch {
		case !ok || user == "" || identity == "":
			errs = append(errs, fmt.Errorf("%q is not USER=IDENTITY", e))
		case user == "*":
			m.anyone = identity
		case strings.HasPrefix(user, "*@"):
			m.domain[strings.ToLower(user[2:])] = identity
		case strings.Contains(user, "*"):
			errs = append(errs, fmt.Errorf("%q: a user is exact, *@DOMAIN or *", e))
		default:
			m.exact[strings.ToLower(user)] = identity
		}
	}
	if len(entries) == 0 {
		errs = append(errs, errors.New("no USER=IDENTITY entry"))
	}
	return m, errors.Join(errs...)
}

// Lookup is the identity of user, if the map names one.
func (m UserMap) Lookup(user string) (string, bool) {
	user = strings.ToLower(user)
	if id, ok := m.exact[user]; ok {
		return id, true
	}
	if at := strings.LastIndexByte(user, '@'); at >= 0 {
		if id, ok := m.domain[user[at+1:]]; ok {
			return id, true
		}
	}
	return m.anyone, m.anyone != ""
}

// Errors of ProxySignIn.Identity.
var (
	ErrUnmappedUser    = errors.New("console: the proxy's user maps to no identity")
	ErrUnknownIdentity = errors.New("console: the proxy's user maps to an identity that the config file does not name")
)

// ProxyIdentityWith is the ProxySignIn.Identity of a server whose
// identities are those current returns: the identity m maps the user to,
// which must be one of them with an admin grant.
func ProxyIdentityWith(current func() *access.Set, m UserMap) func(user string) (string, error) {
	return func(user string) (string, error) {
		name, ok := m.Lookup(user)
		if !ok {
			return "", ErrUnmappedUser
		}
		id, ok := current().ByName(name)
		switch {
		case !ok:
			return name, ErrUnknownIdentity
		case !id.AdministersAny():
			return name, ErrNoAdminGrant
		}
		return name, nil
	}
}

// proxySession is the session of a request the proxy vouches for, made
// or found; nil when the request carries no proxy header (or proxy sign-in
// is off, when the header means nothing). ok is false when the request was
// refused: a header from an untrusted address, or a user that maps to no
// identity that may use the console.
func (c *Console) proxySession(w http.ResponseWriter, r *http.Request) (s *session, ok bool) {
	p := c.cfg.Proxy
	if p == nil {
		return nil, true
	}
	values := r.Header.Values(p.Header)
	if len(values) == 0 {
		return nil, true
	}
	if !p.vouches(r) {
		// The secret header's value is not logged: a proxy misconfigured
		// with a secret one character off would write the real one here.
		c.cfg.Logger.Warn("console sign-in refused", "reason", "proxy header without the proxy's secret", "header", p.Header, "remote", r.RemoteAddr)
		c.refuse(w, r, http.StatusForbidden, "the sign-in header "+p.Header+" is only believed from the console's proxy, which sends its secret in "+ProxySecretHeader+", and this request did not come from it")
		return nil, false
	}
	if len(p.Trusted) > 0 && !c.trustedProxy(r) {
		c.cfg.Logger.Warn("console sign-in refused", "reason", "proxy header from an untrusted address", "header", p.Header, "remote", r.RemoteAddr)
		c.refuse(w, r, http.StatusForbidden, "the sign-in header "+p.Header+" is only believed from the console's proxy, and this request did not come from it")
		return nil, false
	}
	user := strings.TrimSpace(values[0])
	if len(values) > 1 || user == "" {
		c.refuse(w, r, http.StatusForbidden, "the proxy sent "+p.Header+" empty or more than once")
		return nil, false
	}
	identity, err := p.Identity(user)
	if err != nil {
		c.cfg.Logger.Warn("console sign-in refused", "reason", err.Error(), "user", user, "identity", identity, "remote", r.RemoteAddr)
		msg := "user " + user + " maps to no identity of --config (--console-proxy-user)"
		switch {
		case errors.Is(err, ErrNoAdminGrant):
			msg = "user " + user + " maps to identity " + identity + ", which administers no consumer: the console is for identities with an admin grant (admin in --config)"
		case errors.Is(err, ErrUnknownIdentity):
			msg = "user " + user + " maps to identity " + identity + ", which --config does not name"
		}
		c.refuse(w, r, http.StatusForbidden, msg)
		return nil, false
	}
	if ck, err := r.Cookie(cookieName); err == nil {
		c.mu.Lock()
		s := c.sessions[ck.Value]
		c.mu.Unlock()
		if s != nil && s.viaProxy && s.user == user && s.identity == identity && c.cfg.Now().Before(s.expires) {
			return s, true
		}
	}
	s, err = c.addSession(w, &session{identity: identity, user: user, viaProxy: true})
	if err != nil {
		c.refuse(w, r, http.StatusServiceUnavailable, err.Error())
		return nil, false
	}
	c.cfg.Logger.Info("console sign-in", "identity", identity, "user", user, "via", "proxy", "remote", r.RemoteAddr)
	return s, true
}

// vouches says whether r carries the proxy's secret, once. The digests
// are compared, in constant time, so that neither the secret's bytes nor
// its length can be found from how long a refusal takes.
func (p *ProxySignIn) vouches(r *http.Request) bool {
	got := r.Header.Values(ProxySecretHeader)
	if len(got) != 1 || len(p.Secret) < MinProxySecretSize {
		return false
	}
	a, b := sha256.Sum256([]byte(got[0])), sha256.Sum256(p.Secret)
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

func (c *Console) trustedProxy(r *http.Request) bool {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	addr := ap.Addr().Unmap()
	for _, p := range c.cfg.Proxy.Trusted {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}
