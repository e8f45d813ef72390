package server

import (
	"context"
	"time"

	"google.golang.org/grpc"
)

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
