// Package console is the operator console: a small web page,
// served by `idemreg serve --console-listen`, that looks up, lists,
// resolves and invalidates records through the AdminService, one by one
// or many at once, as the signed-in operator's identity.
//
// It holds no authority of its own. Every page is one or more gRPC calls,
// on the server's in-process connection (server.InProcess), made as the
// operator: with the bearer token the operator signed in with, or, for an
// operator a trusted reverse proxy signed in by its header (ProxySignIn),
// naming the identity the proxy's user maps to (Config.ActAs). So the
// AdminService's authorisation decides what the operator may see and do,
// and audits it under that identity. A token stays on the server, in a
// session map keyed by a random id that is the only thing the browser's
// cookie holds. Every state-changing POST carries the session's CSRF
// token, and a POST from another origin is refused
// (net/http.CrossOriginProtection); every value shown goes through
// html/template; stored results are shown as type, size and a hex
// preview, never as markup. A response an operator resolves with is
// checked against its type where the registry knows it (Config.Types) and
// may be typed as JSON, which is encoded here; the confirmation shows it
// as JSON again. States and times are shown for a person (readable.go).
//
// The views are a list (routes table in New): the status panel (store
// health, sweeper lag, parked records per consumer), a look-up, the list of
// parked and stuck records (ListRecords, paged), the record with its
// attempt history, and the actions with a confirmation page each:
// resolving a parked or in-progress record (a result, or a release for a
// fresh attempt), invalidating one, and releasing or invalidating many
// selected on the list (bulk.go: a call, and an audit event, per record).
// Every action names the token the operator saw, so of two operators
// acting on the same record the second is refused (LEASE_LOST) and told
// that someone acted first. The sweeper's lag is the one figure not read
// through the AdminService (Config.SweepLag): it names no record.
package console

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/resulttype"
)

// Defaults of Config.
const (
	DefaultSessionTTL  = 8 * time.Hour
	DefaultMaxSessions = 1024
	// DefaultMaxSessionsPerIdentity: an operator's browsers and a
	// colleague sharing the identity, far below DefaultMaxSessions, so
	// that no identity's sign-ins can fill the console for the others.
	DefaultMaxSessionsPerIdentity = 8
	DefaultCallTimeout            = 10 * time.Second
	// DefaultStuckAfter: a record in progress first claimed longer ago
	// than this is listed by the records page's "stuck" preset.
	DefaultStuckAfter = 15 * time.Minute
	// previewBytes is how much of a stored response the record page shows.
	previewBytes = 64
	// maxReasonBytes mirrors server.MaxReasonBytes, which the AdminService
	// enforces; the form only uses it as its maxlength.
	maxReasonBytes = 256
	// maxFormBytes bounds a POST body: the resolve form's result data
	// (maxResultDataBytes, as text or base64, URL-encoded) and a few short
	// fields.
	maxFormBytes = 64 << 10
)

const cookieName = "idemreg_console"

// Config configures a Console.
type Config struct {
	// Conn reaches the server's AdminService and health service: the
	// server's InProcess connection.
	Conn grpc.ClientConnInterface
	// SignIn checks a bearer token and returns its identity's name, or
	// ErrUnknownToken, or ErrNoAdminGrant for an identity that
	// administers no consumer (SignInWith). Nil means the server has no
	// identities (open, loopback only): no sign-in, and calls carry no
	// credentials.
	SignIn func(token string) (identity string, err error)
	// Proxy, when set, signs operators in from a trusted reverse proxy's
	// header (ProxySignIn); calls for them are made as their identity by
	// name, through ActAs. Off (nil) by default: the header is then
	// ignored.
	Proxy *ProxySignIn
	// ActAs makes ctx a call's as the identity named (server.ActAs on the
	// server's InProcess connection). Required with Proxy.
	ActAs func(ctx context.Context, identity string) context.Context
	// StuckAfter is how long ago a record in progress was first claimed
	// for the records page's "stuck" preset to list it (DefaultStuckAfter).
	StuckAfter time.Duration
	// Secure marks the session cookie Secure (the console is behind TLS).
	Secure bool
	// SessionTTL is how long a sign-in lasts (DefaultSessionTTL).
	SessionTTL time.Duration
	// MaxSessions bounds the sessions held at once (DefaultMaxSessions);
	// beyond it a sign-in is refused until one expires.
	MaxSessions int
	// MaxSessionsPerIdentity bounds the sessions of one identity
	// (DefaultMaxSessionsPerIdentity): a sign-in beyond it ends that
	// identity's oldest session, so that no identity can take the
	// sessions of MaxSessions from the others.
	MaxSessionsPerIdentity int
	// CallTimeout bounds each gRPC call of a page (DefaultCallTimeout).
	CallTimeout time.Duration
	// Logger gets sign-ins and refused requests, never tokens.
	Logger *slog.Logger
	// Now is the clock of session expiry (time.Now).
	Now func() time.Time
	// SweepLag reports, for the status panel, how long the oldest stored
	// record has been expired by the store's clock without being deleted
	// (zero when none is); ok is false when the store holds no record. It
	// is the one figure the console reads other than through the
	// AdminService, as it names no record. Nil: the panel says the lag is
	// not available.
	SweepLag func(ctx context.Context) (lag time.Duration, ok bool, err error)
	// Types are the message types whose responses the resolve form checks
	// and encodes from JSON: the server's own (its ResultTypes), so that
	// the form refuses what the AdminService would. Nil: the linked ones.
	Types *resulttype.Types
}

// Console is the http.Handler of the console.
type Console struct {
	cfg    Config
	admin  idemregv1.AdminServiceClient
	health healthpb.HealthClient
	pages  *template.Template
	mux    *http.ServeMux
	// cop refuses a state-changing request a browser says came from
	// another origin (Sec-Fetch-Site, else Origin against Host).
	cop      *http.CrossOriginProtection
	mu       sync.Mutex
	sessions map[string]*session
}

// session is one signed-in browser. token is sent on every call and never
// back to the browser.
type session struct {
	identity string
	token    string
	// viaProxy: a proxy's header signed it in, as user; calls are made as
	// identity by name.
	viaProxy bool
	user     string
	csrf     string
	created  time.Time
	expires  time.Time
}

//go:embed templates/*.html
var templateFiles embed.FS

//go:embed static
var staticFiles embed.FS

// New returns a console on cfg.Conn.
func New(cfg Config) (*Console, error) {
	if cfg.Conn == nil {
		return nil, errors.New("console: Conn is required")
	}
	if cfg.Proxy != nil && (cfg.ActAs == nil || cfg.Proxy.Header == "" || cfg.Proxy.Identity == nil || len(cfg.Proxy.Secret) < MinProxySecretSize) {
		return nil, fmt.Errorf("console: Proxy needs ActAs, a Header, an Identity mapping and a Secret of at least %d bytes", MinProxySecretSize)
	}
	if cfg.StuckAfter == 0 {
		cfg.StuckAfter = DefaultStuckAfter
	}
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.MaxSessions == 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.MaxSessionsPerIdentity == 0 {
		cfg.MaxSessionsPerIdentity = DefaultMaxSessionsPerIdentity
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	pages, err := template.New("").Funcs(template.FuncMap{
		"maxReason":    func() int { return maxReasonBytes },
		"maxType":      func() int { return maxResultTypeBytes },
		"maxMessage":   func() int { return maxFailureMessageBytes },
		"blankKey":     func() recordKey { return recordKey{} },
		"failureCodes": failureCodes,
		"maxBulk":      func() int { return maxBulkRecords },
	}).ParseFS(templateFiles, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	static, err := fs.Sub(staticFiles, "static")
	if err != nil {
		return nil, err
	}
	c := &Console{
		cfg:      cfg,
		admin:    idemregv1.NewAdminServiceClient(cfg.Conn),
		health:   healthpb.NewHealthClient(cfg.Conn),
		pages:    pages,
		mux:      http.NewServeMux(),
		cop:      http.NewCrossOriginProtection(),
		sessions: make(map[string]*session),
	}
	// The views.
	c.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	c.mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	c.mux.HandleFunc("GET /signin", c.signInPage)
	c.mux.HandleFunc("POST /signin", c.signIn)
	c.mux.HandleFunc("POST /signout", c.signedIn(c.signOut))
	c.mux.HandleFunc("GET /{$}", c.signedIn(c.home))
	c.mux.HandleFunc("GET /records", c.signedIn(c.records))
	c.mux.HandleFunc("GET /record", c.signedIn(c.record))
	c.mux.HandleFunc("POST /resolve", c.signedIn(c.resolve))
	c.mux.HandleFunc("POST /invalidate", c.signedIn(c.invalidate))
	c.mux.HandleFunc("POST /bulk", c.signedIn(c.bulk))
	return c, nil
}

// ServeHTTP implements http.Handler.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "same-origin") // no-referrer would make Chromium send "Origin: null" with the forms
	h.Set("Cache-Control", "no-store")
	// A second line behind the CSRF token and SameSite=Strict, and the
	// only one for the sign-in form, which has no session yet.
	if err := c.cop.Check(r); err != nil {
		c.refuse(w, r, http.StatusForbidden, "cross-origin request refused")
		return
	}
	if r.Method == http.MethodPost {
		// Every form is a few short fields and at most one result's data;
		// a larger body is not one of them.
		limit := int64(maxFormBytes)
		if r.URL.Path == "/bulk" {
			limit = maxBulkFormBytes
		}
		r.Body = http.MaxBytesReader(w, r.Body, limit)
		if err := r.ParseForm(); err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				c.refuse(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("the form is larger than %d bytes", limit))
				return
			}
			c.refuse(w, r, http.StatusBadRequest, "the form cannot be read")
			return
		}
	}
	c.mux.ServeHTTP(w, r)
}

// page is what every template gets.
type page struct {
	Identity string
	CSRF     string
	SignIn   bool // sign-in is on: show the sign-out button
	Error    string
	Notice   string
	Data     any
}

func (c *Console) render(w http.ResponseWriter, code int, name string, p page) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	if err := c.pages.ExecuteTemplate(w, name, p); err != nil {
		c.cfg.Logger.Error("console page failed", "page", name, "error", err)
	}
}

func (c *Console) refuse(w http.ResponseWriter, r *http.Request, code int, msg string) {
	c.cfg.Logger.Warn("console request refused", "method", r.Method, "path", r.URL.Path, "status", code, "reason", msg)
	c.render(w, code, "error.html", page{Error: msg})
}
