// Package console is the operator console of issue 15: a small web page,
// served by `idemreg serve --console-listen`, that looks up, lists,
// resolves and invalidates records through the AdminService, as the
// signed-in identity.
//
// It holds no authority of its own. Every page is one or more gRPC calls on
// the server's own listener carrying the operator's bearer token, so the
// AdminService's authorisation decides what the operator may see and do.
// The token stays on the server, in a session map keyed by a random id that
// is the only thing the browser's cookie holds. Every state-changing POST
// carries the session's CSRF token; every value shown goes through
// html/template; stored results are shown as type, size and a hex preview,
// never as markup. A response an operator resolves with is checked against
// its type where the registry knows it (Config.Types) and may be typed as
// JSON, which is encoded here; the confirmation shows it as JSON again.
//
// The views are a list (routes table in New): the status panel (store
// health, sweeper lag, parked records per consumer), a look-up, the list of
// parked and stuck records (ListRecords, paged), the record with its
// attempt history, and two actions with a confirmation page each:
// resolving a parked or in-progress record (a result, or a release for a
// fresh attempt) and invalidating one. Both actions name the token the
// operator saw, so of two operators acting on the same record the second
// is refused (LEASE_LOST) and told that someone acted first. The sweeper's
// lag is the one figure not read through the AdminService (Config.SweepLag):
// it names no record.
package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
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
	// Conn reaches the server's AdminService and health service, as a
	// loopback connection to its own listener.
	Conn grpc.ClientConnInterface
	// SignIn checks a bearer token and returns its identity's name, or
	// ErrUnknownToken, or ErrNoAdminGrant for an identity that
	// administers no consumer (SignInWith). Nil means the server has no
	// identities (open, loopback only): no sign-in, and calls carry no
	// credentials.
	SignIn func(token string) (identity string, err error)
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
	cfg      Config
	admin    idemregv1.AdminServiceClient
	health   healthpb.HealthClient
	pages    *template.Template
	mux      *http.ServeMux
	mu       sync.Mutex
	sessions map[string]*session
}

// session is one signed-in browser. token is sent on every call and never
// back to the browser.
type session struct {
	identity string
	token    string
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
	if r.Method == http.MethodPost && crossSite(r) {
		c.refuse(w, r, http.StatusForbidden, "cross-site request refused")
		return
	}
	if r.Method == http.MethodPost {
		// Every form is a few short fields and at most one result's data;
		// a larger body is not one of them.
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				c.refuse(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("the form is larger than %d bytes", maxFormBytes))
				return
			}
			c.refuse(w, r, http.StatusBadRequest, "the form cannot be read")
			return
		}
	}
	c.mux.ServeHTTP(w, r)
}

// crossSite reports a request a browser says came from another site. It is
// a second line behind the CSRF token and SameSite=Strict, and the only one
// for the sign-in form, which has no session yet.
// A browser that sends Sec-Fetch-Site is believed; an older one is judged by
// Origin ("null" from a sandboxed or privacy-restricted page is refused).
func crossSite(r *http.Request) bool {
	if s := r.Header.Get("Sec-Fetch-Site"); s != "" {
		return s != "same-origin" && s != "none"
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		return err != nil || u.Host != r.Host
	}
	return false
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

// signedIn runs next with the request's session, sending the browser to
// the sign-in page when there is none. With sign-in off, a browser gets a
// session without credentials at once, for its CSRF token.
func (c *Console) signedIn(next func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s := c.session(r)
		if s == nil && c.cfg.SignIn == nil && r.Method == http.MethodGet {
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
	return s
}

func (c *Console) newSession(w http.ResponseWriter, identity, token string) (*session, error) {
	id, csrf := randomID(), randomID()
	now := c.cfg.Now()
	s := &session{identity: identity, token: token, csrf: csrf, created: now, expires: now.Add(c.cfg.SessionTTL)}
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

func (c *Console) signInPage(w http.ResponseWriter, r *http.Request) {
	if c.cfg.SignIn == nil {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	c.render(w, http.StatusOK, "signin.html", page{})
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
		c.render(w, http.StatusForbidden, "signin.html", page{Error: "identity " + identity + " administers no consumer: the console is for identities with an admin grant (admin in --config)"})
		return
	case err != nil:
		c.cfg.Logger.Warn("console sign-in refused", "reason", "unknown token", "remote", r.RemoteAddr)
		c.render(w, http.StatusUnauthorized, "signin.html", page{Error: "unknown token: give a bearer token of an identity of --config"})
		return
	}
	if _, err := c.newSession(w, identity, r.PostFormValue("token")); err != nil {
		c.render(w, http.StatusServiceUnavailable, "signin.html", page{Error: err.Error()})
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

// SignInWith is the Config.SignIn of a server whose identities are src's:
// a token of an identity that may administer at least one consumer. An
// identity without an admin grant could see nothing in the console, and
// would only take sessions from those who can.
func SignInWith(src *access.Source) func(token string) (string, error) {
	return func(token string) (string, error) {
		id, ok := src.Current().ByToken(token)
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

// callContext is the context of one gRPC call made for s.
func (c *Console) callContext(ctx context.Context, s *session) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	if s.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+s.token)
	}
	return ctx, cancel
}

func (c *Console) page(s *session) page {
	return page{Identity: s.identity, CSRF: s.csrf, SignIn: c.cfg.SignIn != nil}
}

// statusPanel is the home page's view of the server.
type statusPanel struct {
	Store string // SERVING, NOT_SERVING, or the error
	// Lag is the sweeper's lag as the panel says it.
	Lag string
	// Parked is the count of parked records per consumer the identity
	// administers, by name; ParkedError says why it is missing.
	Parked      []parkedCount
	ParkedTotal int64
	ParkedError string
}

// parkedCount is one consumer's line of the status panel.
type parkedCount struct {
	Consumer string
	Count    int64
}

// Link is the records page listing the consumer's parked records.
func (p parkedCount) Link() template.URL {
	return listFilter{Consumer: p.Consumer, Exact: true, State: idemregv1.State_STATE_PARKED}.link("")
}

func (c *Console) home(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	panel := statusPanel{}
	if res, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		panel.Store = "unknown: " + status.Convert(err).Message()
	} else {
		panel.Store = res.GetStatus().String()
	}
	panel.Lag = c.sweepLag(ctx)
	if res, err := c.admin.CountParked(ctx, &idemregv1.CountParkedRequest{}); err != nil {
		_, panel.ParkedError = explain(err)
	} else {
		for consumer, n := range res.GetParked() {
			panel.Parked = append(panel.Parked, parkedCount{Consumer: consumer, Count: n})
			panel.ParkedTotal += n
		}
		slices.SortFunc(panel.Parked, func(a, b parkedCount) int { return strings.Compare(a.Consumer, b.Consumer) })
	}
	p.Data = panel
	c.render(w, http.StatusOK, "home.html", p)
}

// ExpiryReader is the method of storage.Sweeper that SweepLagFrom reads;
// the console names it here rather than import the storage package.
type ExpiryReader interface {
	OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error)
}

// SweepLagFrom is a Config.SweepLag that reads a store's oldest expiry: the
// lag is how long before the store's clock the oldest stored record
// expired, zero when it has not yet.
func SweepLagFrom(store ExpiryReader) func(context.Context) (time.Duration, bool, error) {
	return func(ctx context.Context) (time.Duration, bool, error) {
		oldest, now, ok, err := store.OldestExpiry(ctx)
		if err != nil || !ok {
			return 0, false, err
		}
		return max(now.Sub(oldest), 0), true, nil
	}
}

// sweepLag is the status panel's line about the sweeper.
func (c *Console) sweepLag(ctx context.Context) string {
	if c.cfg.SweepLag == nil {
		return "not available: this server's store does not report it"
	}
	lag, ok, err := c.cfg.SweepLag(ctx)
	switch {
	case err != nil:
		// The store's error may quote its driver: it goes to the log only.
		c.cfg.Logger.Warn("console sweep lag failed", "error", err)
		return "unknown: the store did not answer (the server's log has the error)"
	case !ok:
		return "none: the store holds no record"
	case lag <= 0:
		return "none: no stored record has expired yet"
	default:
		return fmtDuration(lag) + ": the oldest expired record has waited this long to be deleted"
	}
}

// recordKey is the (consumer, kind, key) of a form or query.
type recordKey struct {
	Consumer, Key string
	Kind          idemregv1.Kind
}

func (k recordKey) Query() string {
	return url.Values{"consumer": {k.Consumer}, "kind": {k.Kind.String()}, "key": {k.Key}}.Encode()
}

// Link is the record page of k. It is a template.URL because html/template
// escapes a value after a URL's "?" as one query component, "=" and "&"
// included; Query's encoding already made it safe.
func (k recordKey) Link() template.URL { return template.URL("/record?" + k.Query()) }

func formKey(r *http.Request) (recordKey, error) {
	k := recordKey{Consumer: r.FormValue("consumer"), Key: r.FormValue("key")}
	kind, ok := idemregv1.Kind_value[r.FormValue("kind")]
	if !ok || kind == 0 {
		return k, errors.New("choose a kind: KIND_MESSAGE or KIND_OPERATION")
	}
	k.Kind = idemregv1.Kind(kind)
	if k.Consumer == "" || k.Key == "" {
		return k, errors.New("give a consumer and a key")
	}
	return k, nil
}

// formTarget reads the record key and the token a record page's action
// form carries: the token is the one the operator saw, which the
// AdminService checks, so that an action on a record changed since is
// refused.
func formTarget(r *http.Request) (recordKey, int64, error) {
	k, err := formKey(r)
	if err != nil {
		return k, 0, err
	}
	token, err := strconv.ParseInt(r.PostFormValue("token"), 10, 64)
	if err != nil || token <= 0 {
		return k, 0, errors.New("the form has no record token: look the record up again")
	}
	return k, token, nil
}

// recordView is the record page.
type recordView struct {
	Key        recordKey
	Found      bool
	Live       bool
	StoreTime  string
	State      string
	Token      int64
	Attempt    int64
	Holder     string
	Created    string
	LeaseEnds  string
	LeaseLive  bool
	Completed  string
	Expires    string
	HasFP      bool
	ParkReason string
	Result     *resultView
	History    []attemptView
	// Resolvable: live (ResolveRecord's rule); a completed record only
	// with a result, which repairs the stored one (IsCompleted).
	Resolvable  bool
	IsCompleted bool
	// Form is the resolve form's fields, filled in again when a submission
	// was refused.
	Form resolveForm
}

// attemptView is one earlier attempt of the record page's history.
type attemptView struct {
	Attempt    int64
	Token      int64
	Holder     string
	Acquired   string
	Ended      string
	End        string
	ParkReason string
	Note       string
}

func showHistory(h []*idemregv1.Attempt) []attemptView {
	out := make([]attemptView, 0, len(h))
	for _, a := range h {
		out = append(out, attemptView{
			Attempt: a.GetAttempt(), Token: a.GetToken(), Holder: a.GetHolder(),
			Acquired: when(a.GetAcquiredAt()), Ended: when(a.GetEndedAt()), End: attemptEnd(a.GetEnd()),
			ParkReason: a.GetParkReason(), Note: a.GetNote(),
		})
	}
	return out
}

func attemptEnd(e idemregv1.AttemptEnd) string {
	switch e {
	case idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER:
		return "taken over (its lease ended)"
	case idemregv1.AttemptEnd_ATTEMPT_END_INVALIDATED:
		return "invalidated by an operator"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_COMPLETED:
		return "resolved by an operator: completed"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED:
		return "resolved by an operator: released"
	default:
		return e.String()
	}
}

// resultView shows a stored result without ever rendering it: its type and
// size and a hex preview of its bytes, or a failure's code and message.
type resultView struct {
	Kind, Type, Preview, Message string
	Size                         int
	Truncated                    bool
}

func (c *Console) record(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	k, err := formKey(r)
	if err != nil {
		p.Error = err.Error()
		c.render(w, http.StatusBadRequest, "record.html", p)
		return
	}
	switch r.FormValue("done") {
	case "invalidated":
		p.Notice = "Invalidated: the next Claim of the key acquires it, as a takeover."
	case "completed":
		p.Notice = "Resolved with your result: the record is completed, and every Claim of the key replays it."
	case "released":
		p.Notice = "Resolved by a release: the next Claim of the key acquires it as attempt 1."
	}
	view, code, msg := c.inspect(r.Context(), s, k)
	p.Data, p.Error = view, msg
	c.render(w, code, "record.html", p)
}

func (c *Console) inspect(ctx context.Context, s *session, k recordKey) (recordView, int, string) {
	view := recordView{Key: k}
	ctx, cancel := c.callContext(ctx, s)
	defer cancel()
	res, err := c.admin.InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key})
	if err != nil {
		code, msg := explain(err)
		return view, code, msg
	}
	rec := res.GetRecord()
	view.Found = true
	view.Live = res.GetLive()
	view.StoreTime = when(res.GetStoreTime())
	view.State = rec.GetState().String()
	view.Token = rec.GetToken()
	view.Attempt = rec.GetAttempt()
	view.Holder = rec.GetHolder()
	view.Created = when(rec.GetCreatedAt())
	view.LeaseEnds = when(rec.GetLeaseExpiresAt())
	view.Completed = when(rec.GetCompletedAt())
	view.Expires = when(rec.GetExpiresAt())
	view.HasFP = len(rec.GetFingerprint()) > 0
	view.ParkReason = rec.GetParkReason()
	view.LeaseLive = rec.GetState() == idemregv1.State_STATE_IN_PROGRESS && rec.GetLeaseExpiresAt().AsTime().After(res.GetStoreTime().AsTime())
	if result := rec.GetResult(); result != nil {
		view.Result = showResult(result)
	}
	view.History = showHistory(res.GetHistory())
	view.IsCompleted = rec.GetState() == idemregv1.State_STATE_COMPLETED
	view.Resolvable = view.Live
	view.Form = resolveForm{Action: actionRelease, Outcome: outcomeResponse, Encoding: encodingText}
	return view, http.StatusOK, ""
}

func showResult(res *idemregv1.Result) *resultView {
	if f := res.GetFailure(); f != nil {
		return &resultView{Kind: "failure", Type: codes.Code(f.GetCode()).String(), Message: f.GetMessage(), Size: len(f.GetMessage())}
	}
	data := res.GetResponse().GetData()
	v := &resultView{Kind: "response", Type: res.GetResponse().GetType(), Size: len(data)}
	if len(data) > previewBytes {
		data, v.Truncated = data[:previewBytes], true
	}
	v.Preview = hex.EncodeToString(data)
	return v
}

func when(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return ts.AsTime().UTC().Format(time.RFC3339Nano)
}

// Messages of the refusals an operator acting on a record meets.
const (
	someoneActedFirst = "Someone acted first: the record's token is no longer the one you saw, so nothing was done. Here is the record as it is now: look at it again before you decide."
	alreadyCompleted  = "Refused: the record is completed, and its result is what every Claim replays. Invalidate it to drop the result."
)

// explain turns a call's error into the page's status and message.
func explain(err error) (int, string) {
	st := status.Convert(err)
	switch errorReason(st) {
	case idemregv1.ReasonLeaseLost:
		return http.StatusConflict, someoneActedFirst
	case idemregv1.ReasonAlreadyCompleted:
		return http.StatusConflict, alreadyCompleted
	}
	switch st.Code() {
	case codes.PermissionDenied:
		return http.StatusForbidden, "Permission denied: " + st.Message() + ". Your identity needs an admin grant for this consumer in --config."
	case codes.Unauthenticated:
		return http.StatusUnauthorized, "Not authenticated: " + st.Message() + ". Sign out and sign in again."
	case codes.NotFound:
		return http.StatusNotFound, "No record: " + st.Message()
	case codes.InvalidArgument:
		return http.StatusBadRequest, "Invalid request: " + st.Message()
	case codes.FailedPrecondition:
		return http.StatusConflict, "Refused: " + st.Message() + " (the record changed since it was shown: look it up again)"
	default:
		return http.StatusBadGateway, st.Code().String() + ": " + st.Message()
	}
}

// errorReason is the idemreg ErrorInfo reason of st, or "".
func errorReason(st *status.Status) string {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == idemregv1.ErrorDomain {
			return info.GetReason()
		}
	}
	return ""
}

// confirmView is the confirmation step of an invalidation.
type confirmView struct {
	Key    recordKey
	Token  int64
	Reason string
}

// invalidate is a two-step POST: without confirm=yes it shows what will be
// done and asks; with it, it calls InvalidateRecord with the token the
// record page showed, so that a record changed since is not invalidated.
func (c *Console) invalidate(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	k, token, err := formTarget(r)
	if err != nil {
		p.Error = err.Error()
		c.render(w, http.StatusBadRequest, "error.html", p)
		return
	}
	reason := r.PostFormValue("reason")
	if err := checkReason(reason); err != nil {
		view, code, msg := c.inspect(r.Context(), s, k)
		p.Data, p.Error = view, "A reason is required: say why, for the audit log."
		if reason != "" {
			p.Error = "Not invalidated: " + err.Error() + "."
		}
		if msg != "" {
			p.Error = msg
		}
		c.render(w, max(code, http.StatusBadRequest), "record.html", p)
		return
	}
	if r.PostFormValue("confirm") != "yes" {
		p.Data = confirmView{Key: k, Token: token, Reason: reason}
		c.render(w, http.StatusOK, "confirm.html", p)
		return
	}
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	_, err = c.admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: token, Reason: reason})
	if err != nil {
		code, msg := explain(err)
		view, _, _ := c.inspect(r.Context(), s, k)
		p.Data, p.Error = view, msg
		c.render(w, code, "record.html", p)
		return
	}
	c.cfg.Logger.Info("console invalidation", "identity", s.identity)
	http.Redirect(w, r, "/record?"+k.Query()+"&done=invalidated", http.StatusSeeOther)
}
