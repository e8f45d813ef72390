package idemhttp

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
)

// Header names.
const (
	// KeyHeader carries the idempotency key (the draft's section 2).
	KeyHeader = "Idempotency-Key"
	// ReplayedHeader is "true" on a response replayed from the registry
	// rather than produced by running the handler.
	ReplayedHeader = "Idempotent-Replayed"
)

type attemptKey struct{}

// AttemptFrom returns the claim the handler runs under: its fencing token
// (make the effect conditional on it, as with Once) and its attempt
// number. ok is false outside a keyed request.
func AttemptFrom(ctx context.Context) (a client.Attempt, ok bool) {
	a, ok = ctx.Value(attemptKey{}).(client.Attempt)
	return a, ok
}

// errRetryable is what the Once handler returns for a response the service
// marks retryable: Once releases the key.
var errRetryable = errors.New("idemhttp: a retryable response; the key is released")

// Middleware makes each request with an Idempotency-Key run its handler
// at most once to completion per key and scope, and gives every retry the
// first one's response. scope says whose keys they are: ScopeBy (the
// authenticated caller) or, knowingly, Unscoped; Middleware panics on the
// zero Scope, as on a nil client, since a service built without a scope
// would replay one caller's responses to another. A request with an unsafe
// method, a key K and a scope S is claimed as (WithConsumer's consumer,
// client.KindOperation, RegistryKey(S, K)), its fingerprint (of its
// method, target and body) recorded with its response, and:
//
//   - Acquired: the handler runs with the claim in its context
//     (AttemptFrom), its lease extended while it runs; its response is
//     buffered, recorded (status, WithReplayHeaders' headers, body), and
//     then sent. A status the service marks retryable (DefaultRetryable),
//     or a panic, releases the key instead. Should the registry report the
//     lease lost, the request's context is cancelled with a cause matching
//     client.ErrLeaseLost.
//   - Completed: the recorded response is sent with Idempotent-Replayed:
//     true, without running the handler. A failure stored by a gRPC
//     service or an operator is a problem with its code's HTTP status.
//   - In progress: the duplicate waits for the first request's outcome
//     (client.DefaultInterceptorWait at most, and never past its context)
//     and gets it; then, or at once with
//     WithOnceOptions(client.WithInProgressWait(0)), 409 with Retry-After.
//   - Same key, other method, target or body: 422, once the first
//     request's response is recorded (before that, the wait above).
//   - Parked (an operator must resolve the key): 409 without Retry-After.
//   - Registry unreachable: 503 with Retry-After; the handler does not run
//     (WithRegistryUnavailable(client.FailOpen) runs it anyway).
//   - No key: 400 with WithKeyRequired, else the handler runs as it is.
//     A key that is not a Structured Field String, is empty, or is longer
//     than MaxKeyBytes: 400.
//   - A key whose scope is empty (ScopeBy's function named no caller): 401,
//     never claimed.
//   - A body longer than WithMaxBodyBytes: 413, never claimed.
//
// Safe methods (GET, HEAD, OPTIONS, TRACE) pass through: they are
// idempotent already. A response longer than WithMaxResponseBytes cannot be
// recorded: it goes to the client as the handler writes it, and the key is
// completed with a failure (reason RESPONSE_NOT_RECORDED, 500) that its
// retries get, since the operation did run. A status the service marks
// retryable gives the key back without recording anything: the next
// request with the key runs whatever its payload, so that a request
// refused as sent (400, 422: DefaultRetryable) can be corrected and sent
// again with the same key. Every answer of the middleware itself is
// application/problem+json (RFC 9457).
func Middleware(c *client.Client, scope Scope, opts ...Option) func(http.Handler) http.Handler {
	if c == nil {
		panic("idemhttp.Middleware: nil client")
	}
	if !scope.valid() {
		panic("idemhttp.Middleware: no key scope: pass idemhttp.ScopeBy(the authenticated caller) or, knowing that every caller then shares one key space, idemhttp.Unscoped()")
	}
	s := newSettings(opts)
	s.scope = scope
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			serve(c, s, next, w, r)
		})
	}
}

func safeMethod(m string) bool {
	return m == http.MethodGet || m == http.MethodHead || m == http.MethodOptions || m == http.MethodTrace
}

func serve(c *client.Client, s *settings, next http.Handler, w http.ResponseWriter, r *http.Request) {
	if safeMethod(r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	lines := r.Header.Values(KeyHeader)
	if len(lines) == 0 {
		if s.required {
			writeProblem(w, http.StatusBadRequest, client.ReasonMissingKey,
				"this operation is idempotent and requires an Idempotency-Key header: a unique String per operation, reused on its retries", 0, nil)
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	key, err := parseKey(lines, s.bareTokens)
	if err == nil {
		err = checkKeyLength(key)
	}
	if err != nil {
		writeProblem(w, http.StatusBadRequest, client.ReasonInvalidArgument, "invalid Idempotency-Key: "+err.Error(), 0, nil)
		return
	}
	if !s.scope.unscoped {
		sc := s.scope.of(r)
		if sc == "" {
			// Unscoped, the key would meet every other caller's: refused,
			// before anything is read or claimed.
			writeProblem(w, http.StatusUnauthorized, client.ReasonUnauthenticated,
				"an Idempotency-Key is kept per caller, and this request names no caller: authenticate, then send it again", 0, nil)
			return
		}
		key = RegistryKey(sc, key)
	}
	body, ok := readBody(w, r, s.maxBody)
	if !ok {
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	fp := s.fingerprint(r, body)

	var rec *recorder
	fn := func(ctx context.Context, a client.Attempt) ([]byte, error) {
		rec = newRecorder(w, s.maxResponse)
		next.ServeHTTP(rec, r.WithContext(context.WithValue(ctx, attemptKey{}, a)))
		switch st := rec.stored(s.replayHeaders); {
		case rec.overflow:
			return nil, client.Final(notRecorded(fp).Err())
		case rec.status == 0 && r.Context().Err() != nil:
			return nil, errRetryable // the client left before the handler answered
		case s.retryable(st.status):
			return nil, errRetryable
		default:
			st.fingerprint = fp
			return st.encode(), nil
		}
	}
	// The fingerprint goes with the recorded response, not to the registry:
	// the registry keeps a claim's fingerprint after a release, so a request
	// refused as sent would block its corrected retry with 422 for the whole
	// retention.
	onceOpts := append(append([]client.OnceOption(nil), s.onceOpts...),
		client.WithKind(client.KindOperation), client.WithResultType(ResponseType))
	res, err := c.Once(r.Context(), s.consumer, key, fn, onceOpts...)

	if rec != nil { // the handler ran: its response goes out whatever the bookkeeping did
		if err != nil && !errors.Is(err, errRetryable) && !rec.overflow {
			s.logger.WarnContext(r.Context(), "idemhttp: the response was not recorded; a retry after the lease runs the handler again",
				"consumer", s.consumer, "error", err)
		}
		if !rec.overflow {
			rec.send(nil)
		}
		return
	}
	if res.Replayed {
		replay(s, w, r, fp, res, err)
		return
	}
	if s.failOpen && errors.Is(err, client.ErrUnavailable) {
		s.logger.WarnContext(r.Context(), "idemhttp: registry unavailable; serving without it", "error", err)
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
		return
	}
	answerClaim(s, w, r, err)
}

// readBody buffers the request body up to max bytes, answering 413 or 400
// itself when it cannot.
func readBody(w http.ResponseWriter, r *http.Request, max int64) ([]byte, bool) {
	tooLarge := func() ([]byte, bool) {
		writeProblem(w, http.StatusRequestEntityTooLarge, ReasonBodyTooLarge,
			"the request body is longer than this idempotent operation accepts", 0, nil)
		return nil, false
	}
	if r.ContentLength > max {
		return tooLarge()
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, max+1))
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe), err == nil && int64(len(body)) > max:
		return tooLarge()
	case err != nil:
		writeProblem(w, http.StatusBadRequest, ReasonBodyUnreadable, "the request body could not be read", 0, nil)
		return nil, false
	}
	return body, true
}

// fingerprintMetadata is the ErrorInfo metadata of a stored failure that
// holds the fingerprint (hex) of the request it answered.
const fingerprintMetadata = "fingerprint"

// notRecorded is the failure stored for a response too long to record, to
// the request of fingerprint fp.
func notRecorded(fp []byte) *status.Status {
	st := status.New(codes.Internal, "the first response to this Idempotency-Key was too long to record; it was sent once and cannot be replayed")
	withInfo, err := st.WithDetails(&errdetails.ErrorInfo{Reason: ReasonResponseNotRecorded, Domain: client.ErrorDomain,
		Metadata: map[string]string{fingerprintMetadata: hex.EncodeToString(fp)}})
	if err != nil {
		return st
	}
	return withInfo
}

var replayedHeader = http.Header{ReplayedHeader: {"true"}}

// replay sends a completed key's outcome: the recorded response, or the
// stored failure as a problem; or 422 when the response was recorded for
// another request than fp's.
func replay(s *settings, w http.ResponseWriter, r *http.Request, fp []byte, res client.OnceResult, err error) {
	if err != nil {
		st := status.Convert(err)
		reason := ""
		var e *client.Error
		recorded := res.Record.Fingerprint // a record stored before the fingerprint went with the result
		if errors.As(client.FromStatus(st), &e) {
			reason = e.Reason
			// The middleware's own failure names the request it answered;
			// an operator's resolution answers any.
			if h, ok := e.Metadata[fingerprintMetadata]; ok {
				recorded, _ = hex.DecodeString(h)
			}
		}
		if len(recorded) > 0 && !bytes.Equal(recorded, fp) {
			answerClaim(s, w, r, client.ErrFingerprintMismatch)
			return
		}
		writeProblem(w, httpStatus(st.Code()), reason, st.Message(), 0, replayedHeader)
		return
	}
	stored, derr := decodeResponse(res.Data)
	if derr != nil {
		s.logger.ErrorContext(r.Context(), "idemhttp: a stored response does not decode; the request is not run again until an operator repairs the record",
			"consumer", res.Record.Consumer, "key", res.Record.Key.Key, "error", derr)
		writeProblem(w, http.StatusInternalServerError, client.ReasonStoredResultUnreadable,
			"the stored response of this idempotency key does not decode; the request was not run again", 0, nil)
		return
	}
	// A response recorded before the fingerprint went with it has its
	// fingerprint in the registry's record.
	recorded := stored.fingerprint
	if recorded == nil {
		recorded = res.Record.Fingerprint
	}
	if len(recorded) > 0 && !bytes.Equal(recorded, fp) {
		answerClaim(s, w, r, client.ErrFingerprintMismatch)
		return
	}
	h := w.Header()
	for k, v := range stored.header {
		h[k] = v
	}
	h.Set(ReplayedHeader, "true")
	w.WriteHeader(stored.status)
	_, _ = w.Write(stored.body)
}

// answerClaim answers a request whose handler did not run and that got no
// replay.
func answerClaim(s *settings, w http.ResponseWriter, r *http.Request, err error) {
	var (
		ie *client.InProgressError
		pe *client.ParkedError
		ue *client.UnavailableError
		e  *client.Error
	)
	switch {
	case errors.As(err, &ie):
		writeProblem(w, http.StatusConflict, client.ReasonInProgress,
			"a request with this Idempotency-Key is being processed; retry after the delay in Retry-After", ie.RetryAfter, nil)
	case errors.Is(err, client.ErrFingerprintMismatch):
		writeProblem(w, http.StatusUnprocessableEntity, client.ReasonFingerprintMismatch,
			"this Idempotency-Key was already used with another request (method, target or body); a key must not be reused for a different payload", 0, nil)
	case errors.As(err, &pe):
		writeProblem(w, http.StatusConflict, client.ReasonParked,
			"the operation of this Idempotency-Key is set aside until an operator resolves it; it is not run again", 0, nil)
	case errors.As(err, &ue):
		s.logger.WarnContext(r.Context(), "idemhttp: registry unavailable; the request is not run", "error", err)
		writeProblem(w, http.StatusServiceUnavailable, client.ReasonRegistryUnavailable,
			"the idempotency registry is unavailable; the request was not run, retry later", max(ue.RetryAfter, time.Second), nil)
	case r.Context().Err() != nil:
		// The client is gone; nothing to answer.
	case errors.As(err, &e) && errors.Is(err, client.ErrInvalidArgument) && keyViolation(e):
		writeProblem(w, http.StatusBadRequest, client.ReasonInvalidArgument, "invalid Idempotency-Key: "+e.FieldViolations[0].Description, 0, nil)
	default:
		s.logger.ErrorContext(r.Context(), "idemhttp: claim failed", "consumer", s.consumer, "error", err)
		writeProblem(w, http.StatusInternalServerError, client.ReasonInternal, "idempotency registry error", 0, nil)
	}
}

// keyViolation: the registry refused the key itself, not the middleware's
// configuration (a consumer name or lease it does not accept).
func keyViolation(e *client.Error) bool {
	if len(e.FieldViolations) == 0 {
		return false
	}
	for _, v := range e.FieldViolations {
		if v.Field != "key" {
			return false
		}
	}
	return true
}
