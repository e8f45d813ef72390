package server

import (
	"context"
	"log/slog"
	"strings"
	"time"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
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

// callLog is what inner interceptors tell the access log about the call.
type callLog struct {
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

type accessLogger struct{ logger *slog.Logger }

func (a accessLogger) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	start := time.Now()
	cl := &callLog{}
	resp, err := next(context.WithValue(ctx, callLogKey{}, cl), req)
	var consumer string
	if r, ok := req.(interface{ GetConsumer() string }); ok {
		consumer = r.GetConsumer()
	}
	a.finished(ctx, info.FullMethod, consumer, cl, start, err)
	return resp, err
}

func (a accessLogger) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, next grpc.StreamHandler) error {
	start := time.Now()
	cl := &callLog{}
	err := next(srv, &loggedStream{ServerStream: ss, ctx: context.WithValue(ss.Context(), callLogKey{}, cl)})
	a.finished(ss.Context(), info.FullMethod, "", cl, start, err)
	return err
}

func (a accessLogger) finished(ctx context.Context, fullMethod, consumer string, cl *callLog, start time.Time, err error) {
	code := status.Code(err)
	lvl := codeLevel(code)
	if !a.logger.Enabled(ctx, lvl) {
		return
	}
	service, method, _ := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	attrs := make([]slog.Attr, 0, 8)
	attrs = append(attrs,
		slog.String("grpc.service", service),
		slog.String("grpc.method", method),
		slog.String("grpc.code", codeName(code)),
		slog.Float64("grpc.time_ms", float64(time.Since(start).Microseconds())/1000))
	if consumer != "" {
		// Not validated yet when the call was refused before the handler.
		attrs = append(attrs, slog.String("consumer", echo(consumer)))
	}
	if cl.identity != "" {
		attrs = append(attrs, slog.String("identity", cl.identity))
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		attrs = append(attrs, slog.String("peer.address", p.Addr.String()))
	}
	if err != nil {
		attrs = append(attrs, slog.String("grpc.error", truncate(status.Convert(err).Message(), MaxStatusMessageBytes)))
	}
	a.logger.LogAttrs(ctx, lvl, "finished call", attrs...)
}

// loggedStream carries the call log holder to the stream's handlers.
type loggedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *loggedStream) Context() context.Context { return s.ctx }
