package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"

	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/server/access"
)

// signedIn runs next with the request's session, sending the browser to
// the sign-in page when there is none. With sign-in off, a browser gets a
// session without credentials at once, for its CSRF token.
func (c *Console) signedIn(next func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s, ok := c.proxySession(w, r)
		if !ok {
			return
		}
		if s == nil {
			s = c.session(r)
		}
		if s == nil && c.cfg.SignIn == nil && c.cfg.Proxy == nil && r.Method == http.MethodGet {
			var err error
			if s, err = c.newSession(w, "anonymous", ""); err != nil {
				c.refuse(w, r, http.StatusServiceUnavailable, err.Error())
				return
			}
		}
		if s == nil {
			if r.Method != http.MethodGet {
				c.refuse(w, r, http.StatusForbidden, "not signed in, or the session ended: sign in again")
				return
			}
			http.Redirect(w, r, "/signin", http.StatusSeeOther)
			return
		}
		if r.Method == http.MethodPost && !validCSRF(s, r.PostFormValue("csrf")) {
			c.refuse(w, r, http.StatusForbidden, "the form's CSRF token is missing or wrong: reload the page and try again")
			return
		}
		next(w, r, s)
	}
}

func validCSRF(s *session, got string) bool {
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.csrf)) == 1
}

func (c *Console) session(r *http.Request) *session {
	ck, err := r.Cookie(cookieName)
	if err != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.sessions[ck.Value]
	if !ok {
		return nil
	}
	if !c.cfg.Now().Before(s.expires) {
		delete(c.sessions, ck.Value)
		return nil
	}
	if s.viaProxy {
		// A proxy's sign-in holds only while the proxy vouches for the
		// operator, on every request (proxySession).
		return nil
	}
	return s
}

func (c *Console) newSession(w http.ResponseWriter, identity, token string) (*session, error) {
	return c.addSession(w, &session{identity: identity, token: token})
}

// addSession keeps s, with a fresh id, CSRF token and expiry, and gives the
// browser its cookie.
func (c *Console) addSession(w http.ResponseWriter, s *session) (*session, error) {
	id, csrf := randomID(), randomID()
	now := c.cfg.Now()
	identity := s.identity
	s.csrf, s.created, s.expires = csrf, now, now.Add(c.cfg.SessionTTL)
	c.mu.Lock()
	var (
		mine   int
		oldest string
	)
	for k, old := range c.sessions {
		switch {
		case !now.Before(old.expires):
			delete(c.sessions, k)
		case old.identity == identity:
			mine++
			if oldest == "" || old.created.Before(c.sessions[oldest].created) {
				oldest = k
			}
		}
	}
	evicted := mine >= c.cfg.MaxSessionsPerIdentity
	if evicted {
		delete(c.sessions, oldest)
	}
	full := len(c.sessions) >= c.cfg.MaxSessions
	if !full {
		c.sessions[id] = s
	}
	c.mu.Unlock()
	if full {
		return nil, errors.New("too many console sessions: try again later")
	}
	if evicted {
		c.cfg.Logger.Info("console session ended: the identity signed in again at its bound", "identity", identity, "max_sessions_per_identity", c.cfg.MaxSessionsPerIdentity)
	}
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: id, Path: "/", HttpOnly: true, Secure: c.cfg.Secure,
		SameSite: http.SameSiteStrictMode, Expires: s.expires,
	})
	return s, nil
}

func randomID() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // crypto/rand.Read does not fail
	return base64.RawURLEncoding.EncodeToString(b)
}

// signInView is the sign-in page: the token form when tokens sign in,
// the proxy's header when a proxy does.
type signInView struct {
	Tokens      bool
	ProxyHeader string
}

func (c *Console) signInView() signInView {
	v := signInView{Tokens: c.cfg.SignIn != nil}
	if c.cfg.Proxy != nil {
		v.ProxyHeader = c.cfg.Proxy.Header
	}
	return v
}

func (c *Console) signInPage(w http.ResponseWriter, r *http.Request) {
	if c.cfg.SignIn == nil && c.cfg.Proxy == nil {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	if p := c.cfg.Proxy; p != nil && len(r.Header.Values(p.Header)) > 0 && p.vouches(r) && (len(p.Trusted) == 0 || c.trustedProxy(r)) {
		// The proxy vouches for this request: the pages sign it in.
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	c.render(w, http.StatusOK, "signin.html", page{Data: c.signInView()})
}

func (c *Console) signIn(w http.ResponseWriter, r *http.Request) {
	if c.cfg.SignIn == nil {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	identity, err := c.cfg.SignIn(r.PostFormValue("token"))
	switch {
	case errors.Is(err, ErrNoAdminGrant):
		c.cfg.Logger.Warn("console sign-in refused", "identity", identity, "reason", "no admin grant", "remote", r.RemoteAddr)
		c.render(w, http.StatusForbidden, "signin.html", page{Data: c.signInView(), Error: "identity " + identity + " administers no consumer: the console is for identities with an admin grant (admin in --config)"})
		return
	case err != nil:
		c.cfg.Logger.Warn("console sign-in refused", "reason", "unknown token", "remote", r.RemoteAddr)
		c.render(w, http.StatusUnauthorized, "signin.html", page{Data: c.signInView(), Error: "unknown token: give a bearer token of an identity of --config"})
		return
	}
	if _, err := c.newSession(w, identity, r.PostFormValue("token")); err != nil {
		c.render(w, http.StatusServiceUnavailable, "signin.html", page{Data: c.signInView(), Error: err.Error()})
		return
	}
	c.cfg.Logger.Info("console sign-in", "identity", identity, "remote", r.RemoteAddr)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// Errors of Config.SignIn.
var (
	ErrUnknownToken = errors.New("console: unknown token")
	ErrNoAdminGrant = errors.New("console: the identity administers no consumer")
)

// SignInWith is the Config.SignIn of a server whose identities are those
// current returns (the config file's in force):
// a token of an identity that may administer at least one consumer. An
// identity without an admin grant could see nothing in the console, and
// would only take sessions from those who can.
func SignInWith(current func() *access.Set) func(token string) (string, error) {
	return func(token string) (string, error) {
		id, ok := current().ByToken(token)
		switch {
		case !ok:
			return "", ErrUnknownToken
		case !id.AdministersAny():
			return id.Name, ErrNoAdminGrant
		}
		return id.Name, nil
	}
}

func (c *Console) signOut(w http.ResponseWriter, r *http.Request, _ *session) {
	if ck, err := r.Cookie(cookieName); err == nil {
		c.mu.Lock()
		delete(c.sessions, ck.Value)
		c.mu.Unlock()
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, Secure: c.cfg.Secure, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
}

// callContext is the context of one gRPC call made for s: as its
// identity by name (Config.ActAs) when a proxy signed it in, else with its
// bearer token, so that a token removed from --config ends its sessions.
func (c *Console) callContext(ctx context.Context, s *session) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	switch {
	case s.viaProxy:
		ctx = c.cfg.ActAs(ctx, s.identity)
	case s.token != "":
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+s.token)
	}
	return ctx, cancel
}
