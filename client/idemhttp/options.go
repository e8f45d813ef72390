package idemhttp

import (
	"crypto/sha256"
	"encoding/binary"
	"log/slog"
	"net/http"

	"github.com/idemreg/idemreg/client"
)

// Defaults of the options.
const (
	// DefaultConsumer is the registry consumer keys are claimed under.
	DefaultConsumer = "http"
	// DefaultMaxBodyBytes bounds the request body the middleware buffers to
	// fingerprint it; a longer body is refused with 413 and never claimed.
	DefaultMaxBodyBytes = 1 << 20
	// DefaultMaxResponseBytes bounds the response body recorded for a key:
	// the registry's default --max-result-bytes (1 MiB) less room for the
	// status and headers. A longer response goes to the client as it is
	// written and cannot be replayed (see Middleware).
	DefaultMaxResponseBytes = 1<<20 - 64<<10
)

// DefaultReplayHeaders are the response headers recorded and replayed
// with the status and body: those that describe the body or the resource
// created. Set-Cookie, Date, tracing and rate-limit headers are not among
// them: a replay is not a new response of the same kind, and a cookie
// handed to one client must not be handed to its retries by default.
var DefaultReplayHeaders = []string{
	"Content-Type", "Content-Encoding", "Content-Language", "Content-Location",
	"Location", "ETag", "Last-Modified",
}

// Option configures Middleware.
type Option func(*settings)

type settings struct {
	consumer      string
	required      bool
	bareTokens    bool
	maxBody       int64
	maxResponse   int
	replayHeaders []string
	fingerprint   func(r *http.Request, body []byte) []byte
	scope         Scope
	retryable     func(status int) bool
	onceOpts      []client.OnceOption
	failOpen      bool
	logger        *slog.Logger
}

func newSettings(opts []Option) *settings {
	s := &settings{
		consumer:      DefaultConsumer,
		maxBody:       DefaultMaxBodyBytes,
		maxResponse:   DefaultMaxResponseBytes,
		replayHeaders: DefaultReplayHeaders,
		fingerprint:   DefaultFingerprint,
		retryable:     DefaultRetryable,
		// A duplicate waits for the first request's outcome, as behind the
		// gRPC interceptors.
		onceOpts: []client.OnceOption{client.WithInProgressWait(client.DefaultInterceptorWait)},
		logger:   slog.Default(),
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// WithConsumer sets the registry consumer the keys are claimed under
// (default DefaultConsumer). Give each API its own, so that two services
// that share a registry identity never share keys.
func WithConsumer(name string) Option { return func(s *settings) { s.consumer = name } }

// WithKeyRequired makes a request with an unsafe method (anything but GET,
// HEAD, OPTIONS and TRACE) and no Idempotency-Key fail with 400, as the
// draft's section 2.7 describes for an operation documented to need one.
// Without it such a request runs as it is.
func WithKeyRequired() Option { return func(s *settings) { s.required = true } }

// WithBareTokens also takes a key sent without the double quotes of a
// Structured Field String (Idempotency-Key: abc-123), as many clients
// written for Stripe's API send it, when it is a valid sf-token.
func WithBareTokens() Option { return func(s *settings) { s.bareTokens = true } }

// WithMaxBodyBytes bounds the request body buffered for the fingerprint
// (default DefaultMaxBodyBytes); a longer one is refused with 413.
func WithMaxBodyBytes(n int64) Option { return func(s *settings) { s.maxBody = n } }

// WithMaxResponseBytes bounds the response body recorded for replay
// (default DefaultMaxResponseBytes). Keep it below the registry's
// --max-result-bytes.
func WithMaxResponseBytes(n int) Option { return func(s *settings) { s.maxResponse = n } }

// WithReplayHeaders sets which response headers are recorded and replayed
// (default DefaultReplayHeaders); it replaces the default list.
func WithReplayHeaders(names ...string) Option {
	return func(s *settings) { s.replayHeaders = append([]string(nil), names...) }
}

// WithFingerprint sets the fingerprint of a request (at most 64 bytes),
// given its buffered body; the default is DefaultFingerprint. Leave out
// what varies between honest retries (a timestamp in the body), keep what
// makes a different operation.
func WithFingerprint(fp func(r *http.Request, body []byte) []byte) Option {
	return func(s *settings) { s.fingerprint = fp }
}

// WithRetryable says which response statuses give the key back for a retry
// instead of being recorded (default DefaultRetryable).
func WithRetryable(retryable func(status int) bool) Option {
	return func(s *settings) { s.retryable = retryable }
}

// WithOnceOptions passes options to the Once each keyed request runs
// under: client.WithLease, client.WithRetention, client.WithInProgressWait
// (0 answers a duplicate 409 at once instead of waiting up to
// client.DefaultInterceptorWait for the first request's outcome),
// client.WithWaitInProgress and client.WithBookkeepingTimeout.
func WithOnceOptions(opts ...client.SharedOption) Option {
	return func(s *settings) {
		for _, o := range opts {
			s.onceOpts = append(s.onceOpts, o)
		}
	}
}

// WithRegistryUnavailable says what a keyed request gets when the registry
// cannot be reached: client.FailClosed (the default, as for the gRPC
// interceptors) answers 503 without running the handler; client.FailOpen
// runs it without the registry, so duplicates are not detected until the
// registry is back.
func WithRegistryUnavailable(p client.UnavailablePolicy) Option {
	return func(s *settings) { s.failOpen = p == client.FailOpen }
}

// WithLogger sets where the middleware logs what it cannot tell the client
// (a recording that failed, a stored response that does not decode);
// default slog.Default().
func WithLogger(l *slog.Logger) Option { return func(s *settings) { s.logger = l } }

// DefaultFingerprint is the SHA-256 of the request's method, its target
// (path and query, as sent) and its body, each length-prefixed so that no
// two requests can pass for each other.
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	return lengthPrefixedSHA256([]byte(r.Method), []byte(r.URL.RequestURI()), body)
}

// lengthPrefixedSHA256 is the SHA-256 of parts, each preceded by its length
// (8 bytes, big-endian): two lists of parts hash alike only if they are the
// same list, whatever bytes the parts hold.
func lengthPrefixedSHA256(parts ...[]byte) []byte {
	h := sha256.New()
	for _, part := range parts {
		h.Write(binary.BigEndian.AppendUint64(nil, uint64(len(part))))
		h.Write(part)
	}
	return h.Sum(nil)
}

// DefaultRetryable gives the key back, instead of recording the answer,
// for the statuses that are no outcome of the operation:
//
//   - 400, 401, 403, 413, 414, 415, 422 and 431: the request was refused
//     as sent (malformed, not authenticated, not allowed, too large, or
//     failing validation), so the operation did not start. As Stripe saves
//     nothing when validation fails, the corrected request, sent with the
//     same key, runs; recording the refusal would replay it to every retry
//     for the whole retention.
//   - 408, 425, 429, 502, 503 and 504: the request was not (fully)
//     processed, or may succeed later.
//
// Every other status, 404, 409 and 500 included, is the operation's outcome
// and is replayed to every retry, as the gRPC interceptors store INTERNAL.
// A service whose handler answers one of the first list after acting (a 403
// that is a decision it must not take twice) records it with WithRetryable,
// for instance func(s int) bool { return s != 403 && DefaultRetryable(s) }.
func DefaultRetryable(status int) bool {
	return refusedAsSent(status) || notProcessed(status)
}

func refusedAsSent(status int) bool {
	switch status {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden,
		http.StatusRequestEntityTooLarge, http.StatusRequestURITooLong, http.StatusUnsupportedMediaType,
		http.StatusUnprocessableEntity, http.StatusRequestHeaderFieldsTooLarge:
		return true
	}
	return false
}

func notProcessed(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}
