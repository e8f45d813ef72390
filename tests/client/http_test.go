package client_test

// The net/http middleware of package client/idemhttp against a real
// registry, case by case against draft-ietf-httpapi-idempotency-key-header
// (section numbers of draft 06/07): the requests go through
// net/http/httptest servers, over real connections.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/idemhttp"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// httpService is an HTTP API whose handler runs behind the middleware, on
// a real registry.
type httpService struct {
	reg  *inprocess.Registry
	srv  *httptest.Server
	runs atomic.Int64
}

// Scopes of the tests' services: oneCaller is a service whose every
// request comes from caller-1 (its authentication is not under test);
// byCaller scopes keys by the X-Caller header, the caller the service's
// authentication would have named, empty when none.
var (
	oneCaller = idemhttp.ScopeBy(func(*http.Request) string { return "caller-1" })
	byCaller  = idemhttp.ScopeBy(func(r *http.Request) string { return r.Header.Get("X-Caller") })
)

// oneCallerKey is the registry key of oneCaller's Idempotency-Key key.
func oneCallerKey(key string) client.Key {
	return client.Key{Consumer: idemhttp.DefaultConsumer, Kind: client.KindOperation, Key: idemhttp.RegistryKey("caller-1", key)}
}

// newHTTPService serves h behind the middleware; h's runs are counted.
func newHTTPService(t *testing.T, reg *inprocess.Registry, scope idemhttp.Scope, h http.HandlerFunc, opts ...idemhttp.Option) *httpService {
	t.Helper()
	if reg == nil {
		reg = inprocess.Start(t)
	}
	s := &httpService{reg: reg}
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.runs.Add(1)
		h(w, r)
	})
	s.srv = httptest.NewServer(idemhttp.Middleware(reg.Client, scope, opts...)(counted))
	t.Cleanup(s.srv.Close)
	return s
}

type httpAnswer struct {
	status int
	header http.Header
	body   string
}

// problemBody is an RFC 9457 body with the middleware's reason.
type problemBody struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Reason string `json:"reason"`
}

func (a httpAnswer) problem(t *testing.T) problemBody {
	t.Helper()
	require.Equal(t, "application/problem+json", a.header.Get("Content-Type"), "body: %s", a.body)
	var p problemBody
	require.NoError(t, json.Unmarshal([]byte(a.body), &p))
	require.Equal(t, a.status, p.Status)
	require.Equal(t, "about:blank", p.Type)
	require.Equal(t, http.StatusText(a.status), p.Title)
	return p
}

func (a httpAnswer) replayed() bool { return a.header.Get(idemhttp.ReplayedHeader) == "true" }

// send makes one request; keys are Idempotency-Key field lines as sent.
func (s *httpService) send(t *testing.T, method, target, body string, keys ...string) httpAnswer {
	t.Helper()
	return sendWith(t, http.DefaultClient, method, s.srv.URL+target, body, keys...)
}

func sendWith(t *testing.T, hc *http.Client, method, url, body string, keys ...string) httpAnswer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader(body))
	require.NoError(t, err)
	for _, k := range keys {
		req.Header.Add(idemhttp.KeyHeader, k)
	}
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return httpAnswer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// created answers 201 with a body naming the request, a Location, a cookie
// and a trace header (the last two are not replayed by default).
func created(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	a, _ := idemhttp.AttemptFrom(r.Context())
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/charges/"+strconv.FormatInt(a.Token, 10))
	w.Header().Set("Set-Cookie", "session=abc")
	w.Header().Set("X-Trace", "t1")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"token":%d,"body":%q}`, a.Token, b)
}

// Section 2.6, first request and duplicate: the handler runs once; the
// retry gets the recorded status, the chosen headers and the body, with
// Idempotent-Replayed: true.
func TestHTTPFirstRequestThenReplay(t *testing.T) {
	s := newHTTPService(t, nil, oneCaller, created)
	first := s.send(t, http.MethodPost, "/charges", `{"amount":5}`, `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
	require.Equal(t, http.StatusCreated, first.status)
	require.False(t, first.replayed())
	require.Equal(t, "session=abc", first.header.Get("Set-Cookie"), "the first response is the handler's own")
	require.Contains(t, first.body, `"body":"{\"amount\":5}"`, "the handler reads the buffered body")

	for range 3 {
		again := s.send(t, http.MethodPost, "/charges", `{"amount":5}`, `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		require.Equal(t, http.StatusCreated, again.status)
		require.True(t, again.replayed())
		require.Equal(t, first.body, again.body)
		require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
		require.Equal(t, "application/json", again.header.Get("Content-Type"))
		require.Empty(t, again.header.Get("Set-Cookie"), "a cookie is not replayed unless chosen")
		require.Empty(t, again.header.Get("X-Trace"))
	}
	require.EqualValues(t, 1, s.runs.Load())

	rec, err := s.reg.Client.Lookup(t.Context(), oneCallerKey("8e03978e-40d5-43e8-bc93-6894a57f9324"))
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, rec.State)
	require.Equal(t, idemhttp.ResponseType, rec.Result.Response.Type)

	// Another key is another operation.
	other := s.send(t, http.MethodPost, "/charges", `{"amount":5}`, `"k-2"`)
	require.False(t, other.replayed())
	require.EqualValues(t, 2, s.runs.Load())
}

// Section 2.6: the result of the first request is replayed "success or
// error": a 404, 409 or 500 the handler answered is the operation's
// outcome. (A request refused as sent is not: TestHTTPRefusedAsSentNotRecorded.)
func TestHTTPErrorResponseReplayed(t *testing.T) {
	for _, code := range []int{http.StatusNotFound, http.StatusConflict, http.StatusInternalServerError} {
		t.Run(strconv.Itoa(code), func(t *testing.T) {
			s := newHTTPService(t, nil, oneCaller, func(w http.ResponseWriter, r *http.Request) {
				http.Error(w, "declined", code)
			})
			first := s.send(t, http.MethodPost, "/x", "", `"k"`)
			again := s.send(t, http.MethodPost, "/x", "", `"k"`)
			require.Equal(t, code, first.status)
			require.Equal(t, code, again.status)
			require.True(t, again.replayed())
			require.Equal(t, "declined\n", again.body)
			require.EqualValues(t, 1, s.runs.Load())
		})
	}
}

// Retryable answers and panics are no outcome: the key is given back, and
// the retry runs the handler.
func TestHTTPRetryableAnswerAndPanicRelease(t *testing.T) {
	var n atomic.Int64
	s := newHTTPService(t, nil, oneCaller, func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) {
		case 1:
			http.Error(w, "busy", http.StatusServiceUnavailable)
		case 2:
			panic("handler bug")
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	require.Equal(t, http.StatusServiceUnavailable, s.send(t, http.MethodPost, "/x", "", `"k"`).status)
	// The handler panics: net/http drops the connection, and Go's transport,
	// which takes a request with an Idempotency-Key for an idempotent one,
	// may send it again on a new connection. Either way the key was given
	// back, so a request after the panic runs the handler.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL+"/x", nil)
	require.NoError(t, err)
	req.Header.Set(idemhttp.KeyHeader, `"k"`)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		require.Equal(t, http.StatusCreated, resp.StatusCode, "the transport's retry ran the handler again")
		require.Empty(t, resp.Header.Get(idemhttp.ReplayedHeader))
		_ = resp.Body.Close()
	} else {
		third := s.send(t, http.MethodPost, "/x", "", `"k"`)
		require.Equal(t, http.StatusCreated, third.status)
		require.False(t, third.replayed())
	}
	fourth := s.send(t, http.MethodPost, "/x", "", `"k"`)
	require.True(t, fourth.replayed())
	require.EqualValues(t, 3, s.runs.Load())
}

// Section 2.1: the field is a Structured Field String; section 2.7: a
// malformed key is a 400 problem, and the handler does not run.
func TestHTTPKeySyntax(t *testing.T) {
	tests := []struct {
		name  string
		lines []string
		ok    bool
	}{
		{name: "a String", lines: []string{`"order-42"`}, ok: true},
		{name: "a String with parameters", lines: []string{`"order-43";v=1`}, ok: true},
		{name: "escapes", lines: []string{`"a\"b"`}, ok: true},
		{name: "a bare token", lines: []string{`order-44`}},
		{name: "an integer", lines: []string{`42`}},
		{name: "two field lines", lines: []string{`"a"`, `"b"`}},
		{name: "a list", lines: []string{`"a", "b"`}},
		{name: "unterminated", lines: []string{`"a`}},
		{name: "an empty String (the registry refuses it)", lines: []string{`""`}},
		{name: "longer than the registry's 256 bytes", lines: []string{`"` + strings.Repeat("k", 257) + `"`}},
	}
	s := newHTTPService(t, nil, oneCaller, created)
	runs := int64(0)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := s.send(t, http.MethodPost, "/x", "", tt.lines...)
			if tt.ok {
				runs++
				require.Equal(t, http.StatusCreated, a.status)
			} else {
				require.Equal(t, http.StatusBadRequest, a.status)
				p := a.problem(t)
				require.Equal(t, client.ReasonInvalidArgument, p.Reason)
				require.Contains(t, p.Detail, "Idempotency-Key")
			}
			require.Equal(t, runs, s.runs.Load())
		})
	}

	t.Run("a bare token with WithBareTokens", func(t *testing.T) {
		s := newHTTPService(t, nil, oneCaller, created, idemhttp.WithBareTokens())
		require.Equal(t, http.StatusCreated, s.send(t, http.MethodPost, "/x", "", `order-44`).status)
		require.True(t, s.send(t, http.MethodPost, "/x", "", `"order-44"`).replayed(), "the token and the String are one key")
	})
}

// Sections 2.5 and 2.7: a missing key for an operation that requires one
// is 400; without WithKeyRequired the request runs as it is. Safe methods
// pass through either way.
func TestHTTPMissingKey(t *testing.T) {
	required := newHTTPService(t, nil, oneCaller, created, idemhttp.WithKeyRequired())
	a := required.send(t, http.MethodPost, "/x", "")
	require.Equal(t, http.StatusBadRequest, a.status)
	require.Equal(t, client.ReasonMissingKey, a.problem(t).Reason)
	require.Zero(t, required.runs.Load())
	require.Equal(t, http.StatusCreated, required.send(t, http.MethodGet, "/x", "").status)
	require.Equal(t, http.StatusCreated, required.send(t, http.MethodGet, "/x", "", `"k"`).status)
	require.False(t, required.send(t, http.MethodGet, "/x", "", `"k"`).replayed(), "a GET is not claimed")

	optional := newHTTPService(t, nil, oneCaller, created)
	for range 2 {
		a := optional.send(t, http.MethodPost, "/x", "")
		require.Equal(t, http.StatusCreated, a.status)
		require.False(t, a.replayed())
	}
	require.EqualValues(t, 2, optional.runs.Load())
}

// Sections 2.4 and 2.7: the key reused with another payload (method,
// target or body) is 422; the same payload is a retry.
func TestHTTPKeyReusedWithAnotherPayload(t *testing.T) {
	s := newHTTPService(t, nil, oneCaller, created)
	require.Equal(t, http.StatusCreated, s.send(t, http.MethodPost, "/charges?x=1", `{"amount":5}`, `"k"`).status)
	for _, tt := range []struct{ name, method, target, body string }{
		{"another body", http.MethodPost, "/charges?x=1", `{"amount":6}`},
		{"another path", http.MethodPost, "/refunds?x=1", `{"amount":5}`},
		{"another query", http.MethodPost, "/charges?x=2", `{"amount":5}`},
		{"another method", http.MethodPatch, "/charges?x=1", `{"amount":5}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a := s.send(t, tt.method, tt.target, tt.body, `"k"`)
			require.Equal(t, http.StatusUnprocessableEntity, a.status)
			require.Equal(t, client.ReasonFingerprintMismatch, a.problem(t).Reason)
		})
	}
	require.True(t, s.send(t, http.MethodPost, "/charges?x=1", `{"amount":5}`, `"k"`).replayed())
	require.EqualValues(t, 1, s.runs.Load())

	t.Run("WithFingerprint leaves out what honest retries vary", func(t *testing.T) {
		s := newHTTPService(t, nil, oneCaller, created, idemhttp.WithFingerprint(func(r *http.Request, body []byte) []byte {
			return idemhttp.DefaultFingerprint(r, nil) // the body is not part of the operation
		}))
		require.Equal(t, http.StatusCreated, s.send(t, http.MethodPost, "/c", `{"sent_at":1}`, `"k"`).status)
		require.True(t, s.send(t, http.MethodPost, "/c", `{"sent_at":2}`, `"k"`).replayed())
	})
}

// blockingHTTP is a handler that holds every request until release is called,
// and tells on entered when one starts.
func blockingHTTP() (h http.HandlerFunc, entered chan client.Attempt, release func()) {
	entered = make(chan client.Attempt, 16)
	gate := make(chan struct{})
	var once sync.Once
	h = func(w http.ResponseWriter, r *http.Request) {
		a, _ := idemhttp.AttemptFrom(r.Context())
		entered <- a
		<-gate
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "token %d", a.Token)
	}
	return h, entered, func() { once.Do(func() { close(gate) }) }
}

// Sections 2.6 and 2.7: a retry while the first request is still being
// processed is 409 with Retry-After, when the middleware answers at once.
func TestHTTPConcurrentRequestConflict(t *testing.T) {
	h, entered, release := blockingHTTP()
	t.Cleanup(release)
	s := newHTTPService(t, nil, oneCaller, h, idemhttp.WithOnceOptions(client.WithInProgressWait(0)))
	firstc := make(chan httpAnswer, 1)
	go func() { firstc <- sendWith(t, http.DefaultClient, http.MethodPost, s.srv.URL+"/x", "", `"k"`) }()
	recv(t, entered)

	a := s.send(t, http.MethodPost, "/x", "", `"k"`)
	require.Equal(t, http.StatusConflict, a.status)
	require.Equal(t, client.ReasonInProgress, a.problem(t).Reason)
	secs, err := strconv.Atoi(a.header.Get("Retry-After"))
	require.NoError(t, err)
	require.Positive(t, secs)

	release()
	first := recv(t, firstc)
	require.Equal(t, http.StatusCreated, first.status)
	again := s.send(t, http.MethodPost, "/x", "", `"k"`)
	require.True(t, again.replayed())
	require.Equal(t, first.body, again.body)
	require.EqualValues(t, 1, s.runs.Load())
}

// By default a duplicate waits for the first request's outcome, as behind
// the gRPC interceptors, and gets its response.
func TestHTTPDuplicateWaitsForTheFirst(t *testing.T) {
	h, entered, release := blockingHTTP()
	t.Cleanup(release)
	s := newHTTPService(t, nil, oneCaller, h)
	firstc := make(chan httpAnswer, 1)
	go func() { firstc <- sendWith(t, http.DefaultClient, http.MethodPost, s.srv.URL+"/x", "", `"k"`) }()
	recv(t, entered)
	dupc := make(chan httpAnswer, 1)
	go func() { dupc <- sendWith(t, http.DefaultClient, http.MethodPost, s.srv.URL+"/x", "", `"k"`) }()
	select {
	case a := <-dupc:
		t.Fatalf("the duplicate was answered while the first request ran: %d %s", a.status, a.body)
	case <-time.After(100 * time.Millisecond):
	}
	release()
	first, dup := recv(t, firstc), recv(t, dupc)
	require.Equal(t, http.StatusCreated, dup.status)
	require.True(t, dup.replayed())
	require.Equal(t, first.body, dup.body)
	require.EqualValues(t, 1, s.runs.Load())
}

// As in Once: the handler gets the fencing token, and its lease is
// extended while it runs, so a slow handler keeps its key.
func TestHTTPHeartbeatAndToken(t *testing.T) {
	reg := inprocess.Start(t, shortLeases())
	h, entered, release := blockingHTTP()
	t.Cleanup(release)
	s := newHTTPService(t, reg, oneCaller, h, idemhttp.WithOnceOptions(client.WithLease(60*time.Millisecond), client.WithInProgressWait(0)))
	firstc := make(chan httpAnswer, 1)
	go func() { firstc <- sendWith(t, http.DefaultClient, http.MethodPost, s.srv.URL+"/x", "", `"slow"`) }()
	a := recv(t, entered)
	require.Positive(t, a.Token)
	require.EqualValues(t, 1, a.Attempt)
	require.Equal(t, client.KindOperation, a.Key.Kind)

	k := oneCallerKey("slow")
	rec, err := reg.Client.Lookup(t.Context(), k)
	require.NoError(t, err)
	firstExpiry := rec.LeaseExpiresAt
	// Several leases later the key is still held, by the same token.
	eventually(t, func() bool {
		r, err := reg.Client.Lookup(t.Context(), k)
		return err == nil && r.LeaseExpiresAt.After(firstExpiry.Add(120*time.Millisecond))
	}, "the lease to be extended past three leases")
	dup := s.send(t, http.MethodPost, "/x", "", `"slow"`)
	require.Equal(t, http.StatusConflict, dup.status, "a heartbeat keeps the key from a takeover")

	release()
	first := recv(t, firstc)
	require.Equal(t, fmt.Sprintf("token %d", a.Token), first.body)
	require.EqualValues(t, 1, s.runs.Load())
}

// sendAs makes one request as caller (the X-Caller header byCaller reads;
// none when empty) with the Idempotency-Key key.
func (s *httpService) sendAs(t *testing.T, caller, body, key string) httpAnswer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL+"/charges", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set(idemhttp.KeyHeader, key)
	if caller != "" {
		req.Header.Set("X-Caller", caller)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return httpAnswer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// asCaller answers 201 naming the caller it ran for and the body it got.
func asCaller(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"caller":%q,"body":%q}`, r.Header.Get("X-Caller"), b)
}

// Section 5, issue 35's vulnerability 3: bob sends alice's Idempotency-Key
// with her body, then with another, under his own credentials. Each of his
// requests runs as his own: he gets neither her response nor a 422 telling
// him that her key was used. Her retry still gets her response.
func TestHTTPOneCallerCannotReplayAnothers(t *testing.T) {
	s := newHTTPService(t, nil, byCaller, asCaller)
	alice := s.sendAs(t, "alice", `{"amount":500}`, `"alice-order-1"`)
	require.Equal(t, http.StatusCreated, alice.status)
	require.Contains(t, alice.body, `"caller":"alice"`)

	bob := s.sendAs(t, "bob", `{"amount":500}`, `"alice-order-1"`)
	require.Equal(t, http.StatusCreated, bob.status)
	require.False(t, bob.replayed(), "bob got alice's response: %s", bob.body)
	require.Contains(t, bob.body, `"caller":"bob"`, "bob's own request ran")

	probe := s.sendAs(t, "carol", `{"amount":1}`, `"alice-order-1"`)
	require.Equal(t, http.StatusCreated, probe.status, "another body must not tell carol the key was used: %s", probe.body)
	require.False(t, probe.replayed())
	require.EqualValues(t, 3, s.runs.Load())

	again := s.sendAs(t, "alice", `{"amount":500}`, `"alice-order-1"`)
	require.True(t, again.replayed())
	require.Equal(t, alice.body, again.body)
	require.EqualValues(t, 3, s.runs.Load())
}

// Scope and key are joined unambiguously: scope "alice:x" with key "K" and
// scope "alice" with key "x:K" (the same string once joined with ":") are
// two registry keys, each with its own response.
func TestHTTPScopeAndKeyDoNotCollide(t *testing.T) {
	s := newHTTPService(t, nil, byCaller, asCaller)
	first := s.sendAs(t, "alice:x", `{}`, `"K"`)
	second := s.sendAs(t, "alice", `{}`, `"x:K"`)
	require.Equal(t, http.StatusCreated, first.status)
	require.Equal(t, http.StatusCreated, second.status)
	require.False(t, second.replayed(), "scope alice with key x:K got the response of scope alice:x with key K: %s", second.body)
	require.Contains(t, second.body, `"caller":"alice"`)
	require.EqualValues(t, 2, s.runs.Load())

	k1, k2 := idemhttp.RegistryKey("alice:x", "K"), idemhttp.RegistryKey("alice", "x:K")
	require.NotEqual(t, k1, k2)
	for _, k := range []string{k1, k2} {
		rec, err := s.reg.Client.Lookup(t.Context(), client.Key{Consumer: idemhttp.DefaultConsumer, Kind: client.KindOperation, Key: k})
		require.NoError(t, err, "registry key %s", k)
		require.Equal(t, client.StateCompleted, rec.State)
	}
}

// A request with a key but no caller (ScopeBy's function returns "") is
// refused with 401 and claims nothing: it is never served unscoped, where
// its key would meet every other caller's.
func TestHTTPEmptyScopeRefused(t *testing.T) {
	s := newHTTPService(t, nil, byCaller, asCaller)
	a := s.sendAs(t, "", `{"amount":5}`, `"k"`)
	require.Equal(t, http.StatusUnauthorized, a.status, "body: %s", a.body)
	require.Equal(t, client.ReasonUnauthenticated, a.problem(t).Reason)
	require.Zero(t, s.runs.Load())
	for _, k := range []string{"k", idemhttp.RegistryKey("", "k")} {
		_, err := s.reg.Client.Lookup(t.Context(), client.Key{Consumer: idemhttp.DefaultConsumer, Kind: client.KindOperation, Key: k})
		require.ErrorIs(t, err, client.ErrNotFound, "registry key %q was claimed", k)
	}
	// Without a key the middleware claims nothing anyway: the request runs.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL+"/charges", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
}

// A scope is a choice: the zero Scope does not build a middleware.
func TestHTTPScopeRequired(t *testing.T) {
	reg := inprocess.Start(t)
	require.PanicsWithValue(t,
		"idemhttp.Middleware: no key scope: pass idemhttp.ScopeBy(the authenticated caller) or, knowing that every caller then shares one key space, idemhttp.Unscoped()",
		func() { idemhttp.Middleware(reg.Client, idemhttp.Scope{}) })
	require.Panics(t, func() { idemhttp.Middleware(reg.Client, idemhttp.ScopeBy(nil)) })

	// Unscoped, as before scopes were required: the registry key is the
	// key as sent, and every caller shares it.
	s := newHTTPService(t, reg, idemhttp.Unscoped(), asCaller)
	require.False(t, s.sendAs(t, "alice", `{}`, `"shared"`).replayed())
	require.True(t, s.sendAs(t, "bob", `{}`, `"shared"`).replayed())
	_, err := reg.Client.Lookup(t.Context(), client.Key{Consumer: idemhttp.DefaultConsumer, Kind: client.KindOperation, Key: "shared"})
	require.NoError(t, err)
}

// A record the middleware stored before the fingerprint went with the
// response (the fingerprint in the registry's record, the response without
// it) keeps replaying under Unscoped, whose registry key is the key as
// sent, and another payload is still 422.
func TestHTTPUnscopedRecordsFromBefore(t *testing.T) {
	reg := inprocess.Start(t)
	req, err := http.NewRequest(http.MethodPost, "/charges", nil)
	require.NoError(t, err)
	fp := idemhttp.DefaultFingerprint(req, []byte(`{"amount":5}`))
	// idemreg.http.v1.Response{status: 201, body: "old"}, as it was written.
	old := protowire.AppendTag(nil, 1, protowire.VarintType)
	old = protowire.AppendVarint(old, http.StatusCreated)
	old = protowire.AppendTag(old, 3, protowire.BytesType)
	old = protowire.AppendBytes(old, []byte("old"))
	_, err = reg.Client.Once(t.Context(), idemhttp.DefaultConsumer, "before", func(context.Context, client.Attempt) ([]byte, error) {
		return old, nil
	}, client.WithKind(client.KindOperation), client.WithMessageFingerprint(fp), client.WithResultType(idemhttp.ResponseType))
	require.NoError(t, err)

	s := newHTTPService(t, reg, idemhttp.Unscoped(), created)
	a := s.send(t, http.MethodPost, "/charges", `{"amount":5}`, `"before"`)
	require.Equal(t, http.StatusCreated, a.status)
	require.True(t, a.replayed())
	require.Equal(t, "old", a.body)
	other := s.send(t, http.MethodPost, "/charges", `{"amount":6}`, `"before"`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status)
	require.Equal(t, client.ReasonFingerprintMismatch, other.problem(t).Reason)
	require.Zero(t, s.runs.Load())
}

// A request refused as sent (400, 422) records nothing, as Stripe saves
// nothing when validation fails: the corrected request with the same key
// runs, and is then the key's outcome. WithRetryable records the refusal
// again for a service that wants it.
func TestHTTPRefusedAsSentNotRecorded(t *testing.T) {
	for _, code := range []int{http.StatusBadRequest, http.StatusUnprocessableEntity} {
		t.Run(strconv.Itoa(code), func(t *testing.T) {
			validating := func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				if strings.Contains(string(b), "-") {
					http.Error(w, "amount must be positive", code)
					return
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, "charged %s", b)
			}
			s := newHTTPService(t, nil, oneCaller, validating)
			require.Equal(t, code, s.send(t, http.MethodPost, "/charges", `-5`, `"k"`).status)
			again := s.send(t, http.MethodPost, "/charges", `-5`, `"k"`)
			require.Equal(t, code, again.status)
			require.False(t, again.replayed(), "the refusal was recorded")

			fixed := s.send(t, http.MethodPost, "/charges", `5`, `"k"`)
			require.Equal(t, http.StatusCreated, fixed.status, "the corrected retry was blocked: %s", fixed.body)
			require.False(t, fixed.replayed())
			require.Equal(t, "charged 5", fixed.body)
			require.EqualValues(t, 3, s.runs.Load())

			// From then on the key is the corrected request's.
			require.True(t, s.send(t, http.MethodPost, "/charges", `5`, `"k"`).replayed())
			reuse := s.send(t, http.MethodPost, "/charges", `-5`, `"k"`)
			require.Equal(t, http.StatusUnprocessableEntity, reuse.status)
			require.Equal(t, client.ReasonFingerprintMismatch, reuse.problem(t).Reason)
			require.EqualValues(t, 3, s.runs.Load())

			stored := newHTTPService(t, nil, oneCaller, validating,
				idemhttp.WithRetryable(func(st int) bool { return st != code && idemhttp.DefaultRetryable(st) }))
			require.Equal(t, code, stored.send(t, http.MethodPost, "/charges", `-5`, `"k"`).status)
			require.True(t, stored.send(t, http.MethodPost, "/charges", `-5`, `"k"`).replayed())
			require.EqualValues(t, 1, stored.runs.Load())
		})
	}
}

// Bounded buffering: a body over the bound is 413 and never claimed; a
// response over its bound goes out once, and its retries learn it was not
// recorded rather than running the operation again.
func TestHTTPBounds(t *testing.T) {
	s := newHTTPService(t, nil, oneCaller, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write(bytes.Repeat([]byte("r"), 100))
	}, idemhttp.WithMaxBodyBytes(16), idemhttp.WithMaxResponseBytes(64))

	a := s.send(t, http.MethodPost, "/x", strings.Repeat("b", 17), `"big-body"`)
	require.Equal(t, http.StatusRequestEntityTooLarge, a.status)
	require.Equal(t, idemhttp.ReasonBodyTooLarge, a.problem(t).Reason)
	require.Zero(t, s.runs.Load())
	_, err := s.reg.Client.Lookup(t.Context(), oneCallerKey("big-body"))
	require.ErrorIs(t, err, client.ErrNotFound)

	// A chunked body (no Content-Length) is bounded too.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL+"/x", io.MultiReader(strings.NewReader(strings.Repeat("b", 40))))
	require.NoError(t, err)
	req.Header.Set(idemhttp.KeyHeader, `"chunked"`)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	require.Zero(t, s.runs.Load())

	first := s.send(t, http.MethodPost, "/x", "small", `"big-answer"`)
	require.Equal(t, http.StatusOK, first.status)
	require.Len(t, first.body, 100, "the whole response reaches the client once")
	again := s.send(t, http.MethodPost, "/x", "small", `"big-answer"`)
	require.Equal(t, http.StatusInternalServerError, again.status)
	require.True(t, again.replayed())
	require.Equal(t, idemhttp.ReasonResponseNotRecorded, again.problem(t).Reason)
	other := s.send(t, http.MethodPost, "/x", "other", `"big-answer"`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "the stored failure answers its own request only")
	require.Equal(t, client.ReasonFingerprintMismatch, other.problem(t).Reason)
	require.EqualValues(t, 1, s.runs.Load())
}

// A registry that cannot be reached: 503 with Retry-After, and the
// handler does not run.
func TestHTTPRegistryUnavailable(t *testing.T) {
	reg := inprocess.Start(t)
	s := newHTTPService(t, reg, oneCaller, created)
	require.NoError(t, reg.Stop())
	a := s.send(t, http.MethodPost, "/x", "", `"k"`)
	require.Equal(t, http.StatusServiceUnavailable, a.status)
	require.Equal(t, client.ReasonRegistryUnavailable, a.problem(t).Reason)
	require.NotEmpty(t, a.header.Get("Retry-After"))
	require.Zero(t, s.runs.Load())

	// Failing open, the handler runs without the registry, with no claim.
	var attempt atomic.Bool
	open := newHTTPService(t, reg, oneCaller, func(w http.ResponseWriter, r *http.Request) {
		_, ok := idemhttp.AttemptFrom(r.Context())
		attempt.Store(ok)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	}, idemhttp.WithRegistryUnavailable(client.FailOpen))
	a = open.send(t, http.MethodPost, "/x", "the body", `"k"`)
	require.Equal(t, http.StatusCreated, a.status)
	require.Equal(t, "the body", a.body, "the handler reads the whole body")
	require.False(t, attempt.Load(), "no claim, so no attempt in the context")
}

// A real HTTP client racing duplicates: many connections send the same
// keys at once. Each key's handler runs once, and every request gets its
// response, run or replayed.
func TestHTTPRacingDuplicates(t *testing.T) {
	var mu sync.Mutex
	ran := map[string]int{}
	s := newHTTPService(t, nil, oneCaller, func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.KeyHeader)
		mu.Lock()
		ran[key]++
		mu.Unlock()
		time.Sleep(5 * time.Millisecond) // long enough for duplicates to arrive while it runs
		a, _ := idemhttp.AttemptFrom(r.Context())
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s %d", key, a.Token)
	})
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64}}
	t.Cleanup(hc.CloseIdleConnections)

	const keys, copies = 8, 8
	answers := make([][]httpAnswer, keys)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for k := range keys {
		answers[k] = make([]httpAnswer, copies)
		for c := range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				answers[k][c] = sendWith(t, hc, http.MethodPost, s.srv.URL+"/pay", `{"amount":1}`, fmt.Sprintf(`"pay-%d"`, k))
			}()
		}
	}
	close(start)
	wg.Wait()

	for k := range keys {
		key := fmt.Sprintf(`"pay-%d"`, k)
		assert.Equal(t, 1, ran[key], "runs of %s", key)
		replays := 0
		for _, a := range answers[k] {
			require.Equal(t, http.StatusCreated, a.status, "body: %s", a.body)
			require.Equal(t, answers[k][0].body, a.body)
			if a.replayed() {
				replays++
			}
		}
		assert.Equal(t, copies-1, replays, "all but the one that ran are replays of %s", key)
	}
	require.EqualValues(t, keys, s.runs.Load())
}

// As in Once: should the registry give the key to another holder while a
// handler runs (its lease ran out on the registry's clock), the handler's
// request context is cancelled with a cause matching client.ErrLeaseLost,
// and the takeover runs with a larger token.
func TestHTTPLeaseLostCancelsTheRequest(t *testing.T) {
	var offset atomic.Int64 // the registry's clock, ahead of the real one
	reg := inprocess.Start(t, shortLeases(),
		inprocess.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))
	type run struct {
		a     client.Attempt
		cause error
	}
	entered, ended := make(chan client.Attempt, 2), make(chan run, 2)
	var n atomic.Int64
	s := newHTTPService(t, reg, oneCaller, func(w http.ResponseWriter, r *http.Request) {
		a, _ := idemhttp.AttemptFrom(r.Context())
		entered <- a
		if n.Add(1) == 1 {
			<-r.Context().Done() // the first holder works until told it lost the key
			ended <- run{a, context.Cause(r.Context())}
			http.Error(w, "stopped", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}, idemhttp.WithOnceOptions(client.WithLease(400*time.Millisecond), client.WithInProgressWait(0)))

	firstc := make(chan httpAnswer, 1)
	go func() { firstc <- sendWith(t, http.DefaultClient, http.MethodPost, s.srv.URL+"/x", "", `"k"`) }()
	first := recv(t, entered)
	offset.Store(int64(time.Hour)) // the first holder's lease is over on the registry's clock
	second := s.send(t, http.MethodPost, "/x", "", `"k"`)
	require.Equal(t, http.StatusCreated, second.status, "the takeover ran: %s", second.body)
	takeover := recv(t, entered)
	require.Greater(t, takeover.Token, first.Token)
	require.EqualValues(t, 2, takeover.Attempt)

	lost := recv(t, ended)
	require.ErrorIs(t, lost.cause, client.ErrLeaseLost, "the first handler's context names the loss")
	require.Equal(t, http.StatusServiceUnavailable, recv(t, firstc).status)
	require.True(t, s.send(t, http.MethodPost, "/x", "", `"k"`).replayed(), "the takeover's response is the recorded one")
}
