package server

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// The access log: one structured line per finished call ("finished call",
// with grpc.service, grpc.method, grpc.code, grpc.time_ms, consumer,
// identity, peer.address and, for a failed call, grpc.error: the status
// message, which quotes a request field only cut to MaxEchoedFieldBytes),
// never payloads, results, fingerprints or tokens. The level follows the code, as go-grpc-middleware's logging
// interceptor does on a server: INFO for success and the caller's own
// mistakes, WARN for refusals and unavailability, ERROR for faults.
//
// It is ours rather than go-grpc-middleware's logging interceptor because
// that one builds and merges its fields for every call before the logger
// is asked whether the line is wanted: under load, with the level at WARN,
// it took a tenth of the server's CPU and a fifth of its allocated bytes
// (docs/benchmarks.md). Here a call costs a clock read and one small
// allocation until the line is known to be written.
//
// The line is written when gRPC reports the call ended (a stats.Handler's
// End), not when the interceptors return: a response that fails to encode
// is answered INTERNAL by gRPC after every interceptor has seen a success,
// and the line must say what the caller got. The unary interceptor only
// notes the request's consumer.
//
// callLog is what the interceptors tell the access log about the call.
type callLog struct {
	method   string
	start    time.Time
	consumer string
	identity string
}

type callLogKey struct{}

// noteIdentity records the caller's identity for the call's log line.
func noteIdentity(ctx context.Context, name string) {
	if cl, ok := ctx.Value(callLogKey{}).(*callLog); ok {
		cl.identity = name
	}
}

// codeName spells a code as google.rpc.Code does ("NOT_FOUND",
// "CANCELLED"): as the docs, the status details and otelgrpc's metrics
// (rpc.response.status_code) spell it, so that a log line and a metric of
// the same calls can be matched on it. grpc-go's String is "NotFound".
func codeName(c codes.Code) string { return rpccode.Code(c).String() }

// codeLevel is the level of a finished call's line.
func codeLevel(c codes.Code) slog.Level {
	switch c {
	case codes.OK, codes.NotFound, codes.Canceled, codes.AlreadyExists, codes.InvalidArgument, codes.Unauthenticated:
		return slog.LevelInfo
	case codes.DeadlineExceeded, codes.PermissionDenied, codes.ResourceExhausted, codes.FailedPrecondition, codes.Aborted,
		codes.OutOfRange, codes.Unavailable:
		return slog.LevelWarn
	default:
		return slog.LevelError
	}
}

// accessLogger writes the access log. It is a stats.Handler (the line, at
// the call's End) and a unary interceptor (the request's consumer).
type accessLogger struct {
	logger *slog.Logger
	// refusals samples the lines of refused calls; nil writes them all.
	refusals *refusalSampler
	m        *metrics
}

var _ stats.Handler = accessLogger{}

// TagRPC starts the call's log holder, before any interceptor runs.
func (a accessLogger) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, callLogKey{}, &callLog{method: info.FullMethodName, start: time.Now()})
}

// HandleRPC writes the line when the call has ended, with the status gRPC
// sent.
func (a accessLogger) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	if !ok {
		return
	}
	if cl, ok := ctx.Value(callLogKey{}).(*callLog); ok {
		a.finished(ctx, cl, end.Error)
	}
}

func (accessLogger) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (accessLogger) HandleConn(context.Context, stats.ConnStats) {}

// unary notes the request's consumer for the call's line, and sets the
// call's attributes on its span when the span is recording (below).
func (a accessLogger) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	cl, _ := ctx.Value(callLogKey{}).(*callLog)
	if cl != nil {
		if r, ok := req.(interface{ GetConsumer() string }); ok {
			cl.consumer = r.GetConsumer()
		}
	}
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return next(ctx, req)
	}
	traceRequest(span, req)
	resp, err := next(ctx, req)
	identity := ""
	if cl != nil {
		identity = cl.identity
	}
	traceAnswer(span, identity, resp, err)
	return resp, err
}

func (a accessLogger) finished(ctx context.Context, cl *callLog, err error) {
	code := status.Code(err)
	lvl := codeLevel(code)
	if !a.logger.Enabled(ctx, lvl) {
		return
	}
	var sampledOut int64
	if a.refusals != nil && sampled(code) {
		ok, before := a.refusals.admit(time.Now(), cl.identity, code)
		if !ok {
			a.m.logSampled.Add(ctx, 1, codeAttr(code))
			return
		}
		sampledOut = before
	}
	service, method, _ := strings.Cut(strings.TrimPrefix(cl.method, "/"), "/")
	attrs := make([]slog.Attr, 0, 8)
	attrs = append(attrs,
		slog.String("grpc.service", service),
		slog.String("grpc.method", method),
		slog.String("grpc.code", codeName(code)),
		slog.Float64("grpc.time_ms", float64(time.Since(cl.start).Microseconds())/1000))
	if cl.consumer != "" {
		// Not validated yet when the call was refused before the handler.
		attrs = append(attrs, slog.String("consumer", reason.Echo(cl.consumer)))
	}
	if cl.identity != "" {
		attrs = append(attrs, slog.String("identity", cl.identity))
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		attrs = append(attrs, slog.String("peer.address", p.Addr.String()))
	}
	if err != nil {
		attrs = append(attrs, slog.String("grpc.error", reason.Bounded(status.Convert(err).Message(), MaxStatusMessageBytes)))
	}
	if sampledOut > 0 {
		attrs = append(attrs, slog.Int64("log.sampled_out", sampledOut))
	}
	a.logger.LogAttrs(ctx, lvl, "finished call", attrs...)
}

// Sampling the lines of refused calls. A caller can send refused calls as
// fast as the server answers them (measured: 74k in 8 s, an INFO line each,
// 341 MB of log for 1.2M calls), and a line costs more CPU than the rest
// of the refusal's handling by the server's own code. So the lines of
// refusals are sampled per identity (none, for a caller not authenticated)
// and code: at most RefusalLogRate lines a second each. The line written
// after some were left out says how many (log.sampled_out), and
// idemreg.access_log.sampled_out counts them; the refusals themselves are
// all counted by the metrics (rpc.server.call.duration by code,
// idemreg.auth.denied, idemreg.rate_limited, ...).
//
// DefaultRefusalLogRate is the default number of access log lines a second
// written for each identity and refusal code.
const DefaultRefusalLogRate = 10

// sampled reports whether the lines of calls ended with code are sampled:
// the refusals a caller can repeat at will without reaching the store.
// Faults (INTERNAL), the store's answers and its unavailability are never
// sampled.
func sampled(code codes.Code) bool {
	switch code {
	case codes.Unauthenticated, codes.PermissionDenied, codes.ResourceExhausted, codes.InvalidArgument:
		return true
	}
	return false
}

type sampleKey struct {
	identity string
	code     codes.Code
}

type sampleWindow struct {
	second  int64
	written int
	out     int64 // left out since the last line written
}

// refusalSampler admits at most perSecond lines a second per key.
type refusalSampler struct {
	perSecond int
	mu        sync.Mutex
	windows   map[sampleKey]*sampleWindow
}

// maxSampleKeys bounds the windows kept. Identities come from the config
// file, so this is only a net against one that names very many.
const maxSampleKeys = 4096

func newRefusalSampler(perSecond int) *refusalSampler {
	return &refusalSampler{perSecond: perSecond, windows: map[sampleKey]*sampleWindow{}}
}

// admit reports whether the line of a refusal of identity with code is
// written at now and, if it is, how many of the key's lines were left out
// since the last one written.
func (s *refusalSampler) admit(now time.Time, identity string, code codes.Code) (ok bool, out int64) {
	sec := now.Unix()
	k := sampleKey{identity: identity, code: code}
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.windows[k]
	if w == nil {
		if len(s.windows) >= maxSampleKeys {
			clear(s.windows)
		}
		w = &sampleWindow{second: sec}
		s.windows[k] = w
	}
	if w.second != sec {
		w.second, w.written = sec, 0
	}
	if w.written >= s.perSecond {
		w.out++
		return false, 0
	}
	w.written++
	out, w.out = w.out, 0
	return true, out
}

// Attributes of the call's span (otelgrpc's server span), set from what
// the access log's interceptor has at hand, and only when the span is
// recording (a sampled call): an unsampled call pays one context lookup.
// Their values are bounded: consumers are validated names (or refused),
// kinds and outcomes are enum names, reasons are the API's.
const (
	AttrConsumer = attribute.Key("idemreg.consumer")
	AttrKind     = attribute.Key("idemreg.kind")
	AttrIdentity = attribute.Key("idemreg.identity")
	// AttrOutcome is a Claim's outcome (OUTCOME_ACQUIRED, ...), OK for
	// another call that succeeded, or the error reason of a refused or
	// failed call (LEASE_LOST, RATE_LIMITED, STORE_UNAVAILABLE, ...).
	AttrOutcome = attribute.Key("idemreg.outcome")
)

// traceRequest sets the request's attributes on span.
func traceRequest(span trace.Span, req any) {
	if r, ok := req.(interface{ GetConsumer() string }); ok {
		if c := r.GetConsumer(); c != "" {
			span.SetAttributes(AttrConsumer.String(c))
		}
	}
	if r, ok := req.(interface{ GetKind() idemregv1.Kind }); ok {
		span.SetAttributes(AttrKind.String(r.GetKind().String()))
	}
}

// traceAnswer sets the call's outcome (and the caller's identity, known
// once authentication ran) on span.
func traceAnswer(span trace.Span, identity string, resp any, err error) {
	if identity != "" {
		span.SetAttributes(AttrIdentity.String(identity))
	}
	if err != nil {
		if r := errorReason(err); r != "" {
			span.SetAttributes(AttrOutcome.String(r))
		}
		return
	}
	if r, ok := resp.(interface{ GetOutcome() idemregv1.Outcome }); ok {
		span.SetAttributes(AttrOutcome.String(r.GetOutcome().String()))
		return
	}
	span.SetAttributes(AttrOutcome.String("OK"))
}

// errorReason is the google.rpc.ErrorInfo reason of a status error, empty
// for none.
func errorReason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}
