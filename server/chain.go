package server

import (
	"context"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"google.golang.org/grpc"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// The middleware chain, outermost first. Before it, otelgrpc's stats
// handler opens the call's span and measures it (every call, health checks
// left out of traces).
//  1. access log (accesslog.go): notes the consumer for the line per
//     finished call (method, code, duration, consumer, identity — never
//     payloads, results, fingerprints or tokens) that its stats handler
//     writes when gRPC has sent the status;
//  2. recovery: a panic, here or below, becomes INTERNAL and is logged
//     with its stack;
//  3. deadline: a request without a deadline gets RequestTimeout, a longer
//     one is clamped to MaxRequestTimeout;
//     then refusals (refusals.go): a refusal by any step below, of a
//     caller (identity, or source address) over its RefusalRate, is
//     answered only after RefusalDelay;
//  4. authentication (go-grpc-middleware auth, skipped for health and
//     reflection by selector): the caller's identity from a bearer token
//     or a verified client certificate, or UNAUTHENTICATED;
//  5. a request that did not decode is refused (codec.go): INVALID_ARGUMENT,
//     reason MALFORMED_REQUEST;
//  6. authorization (same selector): the identity may use the request's
//     consumer (RegistryService) or administer it (AdminService; for a
//     request by consumer prefix, at least one consumer under it, and the
//     handler shows only those), or PERMISSION_DENIED — before the handler
//     has read anything;
//  7. calls per identity (server/internal/admission): an identity with MaxCallsPerIdentity
//     calls in progress gets RESOURCE_EXHAUSTED, TOO_MANY_CALLS;
//  8. rate limit: the identity's token bucket, then the consumer's, or
//     RESOURCE_EXHAUSTED with QuotaFailure and RetryInfo; each item of a
//     batch on its own (batch.go).
//
// Below the handlers of both services, the store is wrapped in one chain
// (server/internal/storechain): a record operation gets the request's
// deadline less a margin, is bounded in flight (UNAVAILABLE, OVERLOADED,
// beyond MaxInFlight, or beyond MaxInFlightPerIdentity for one identity) and
// measured, in one place.
func (s *Server) unaryInterceptors() []grpc.UnaryServerInterceptor {
	logger := s.cfg.Logger
	protected := selector.MatchFunc(func(ctx context.Context, c interceptors.CallMeta) bool { return !public(ctx, c) })
	return []grpc.UnaryServerInterceptor{
		s.accessLog.unary,
		recovery.UnaryServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
		s.deadline,
		s.refusals.intercept,
		selector.UnaryServerInterceptor(auth.UnaryServerInterceptor(s.authenticate), protected),
		refuseMalformed,
		selector.UnaryServerInterceptor(s.authorize, protected),
		selector.UnaryServerInterceptor(s.admission.CallsPerIdentity, protected),
		s.rateLimit,
	}
}

// streamInterceptors: every streaming method is public (health's Watch,
// reflection); any other is refused, since authorization needs the
// request's consumer.
func (s *Server) streamInterceptors() []grpc.StreamServerInterceptor {
	logger := s.cfg.Logger
	protected := selector.MatchFunc(func(ctx context.Context, c interceptors.CallMeta) bool { return !public(ctx, c) })
	return []grpc.StreamServerInterceptor{
		recovery.StreamServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
		selector.StreamServerInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, _ grpc.StreamHandler) error {
			return reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED, "streaming methods are not open to identities", nil)
		}, protected),
		// What is left is public: bounded in number, since no credential
		// stands behind it.
		s.admission.PublicStream,
	}
}

func panicHandler(logger *slog.Logger) recovery.RecoveryHandlerFuncContext {
	return func(ctx context.Context, p any) error {
		logger.ErrorContext(ctx, "panic recovered", "panic", p, "stack", string(debug.Stack()))
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
}

// chainUnary chains interceptors, outermost first, into one: the server
// runs the same chain for its unary methods whether grpc-go calls them as
// unary or the server carries them as client streams (carriedUnary).
func chainUnary(interceptors ...grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		next := handler
		for i := len(interceptors) - 1; i >= 0; i-- {
			in, h := interceptors[i], next
			next = func(ctx context.Context, req any) (any, error) { return in(ctx, req, info, h) }
		}
		return next(ctx, req)
	}
}

// chainStream chains stream interceptors, outermost first, into one.
func chainStream(interceptors ...grpc.StreamServerInterceptor) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		next := handler
		for i := len(interceptors) - 1; i >= 0; i-- {
			in, h := interceptors[i], next
			next = func(srv any, ss grpc.ServerStream) error { return in(srv, ss, info, h) }
		}
		return next(srv, ss)
	}
}

// Defaults of the request budget.
const (
	// DefaultRequestTimeout is the budget of a request that carries no
	// deadline: every call is one or a few store round trips, so a call
	// still running after it is stuck behind something.
	DefaultRequestTimeout = 5 * time.Second
	// DefaultMaxRequestTimeout caps the deadline a request may carry, so
	// that a caller cannot hold a store connection or an in-flight slot for
	// minutes. It stays below the default keepalive MaxConnectionAgeGrace
	// (this plus 5 s), so a connection being recycled lets its last calls
	// finish.
	DefaultMaxRequestTimeout = 30 * time.Second
)

// deadline gives a request without a deadline the server's budget and
// clamps one that is further away than the maximum. Store calls take the
// request's context, so they are bounded by the same deadline.
func (s *Server) deadline(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	budget := s.cfg.RequestTimeout
	if d, ok := ctx.Deadline(); ok {
		if time.Until(d) <= s.cfg.MaxRequestTimeout {
			return next(ctx, req)
		}
		budget = s.cfg.MaxRequestTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	return next(ctx, req)
}
