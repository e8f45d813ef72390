package server

import (
	"context"
	"net"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/server/access"
)

// Slowing callers that keep drawing refusals (issue 35, weakness 8). A
// refused call is cheap for the server but not free: a closed loop of
// refused calls, which nothing made the caller wait for, took 80% of a
// neighbour's throughput, and an identity's rate limit does not apply to
// calls refused before it (or to its own refusals). So each caller gets
// a budget of refusals, a token bucket of RefusalRate a second (burst
// twice that): beyond it, a refusal is answered only after RefusalDelay,
// and a closed loop of them falls to about a call a second on each of
// its streams, its CPU with it. Accepted calls are never held, and neither is
// anything a caller within its budget is refused.
//
// The caller is its identity when it has one (the budget follows it from
// every address it calls from), its source address (the remote IP) when
// it has none: UNAUTHENTICATED, an open server's anonymous callers, the
// peers' Wake. Held refusals are bounded, per caller
// (MaxHeldRefusalsPerCaller) and in all (MaxHeldRefusals), so that
// holding cannot become a memory attack: a refusal beyond them is
// answered at once, and counted. Only unary calls are held: a streaming
// method is public, bounded in number (MaxPublicStreams), or refused at
// once (chain.go).

// DefaultRefusalRate is the refusals a second a caller (an identity, or
// a source address for a caller without one) may draw before they are
// held, serve's --refusal-rate. Server.Config's zero holds none.
const DefaultRefusalRate = 100

// DefaultRefusalDelay is how long a refusal beyond the budget is held.
const DefaultRefusalDelay = time.Second

// The bounds of held refusals, at about 24 KiB each (7 KiB of heap and a
// 16 KiB stack: BenchmarkHeldRefusals): per caller, 1,024, sixteen
// connections' streams (DefaultMaxConcurrentStreams), so that a flooder
// must open more than that to have any refusal answered at once (with 64
// a caller, 4 connections of 64 refused calls took a neighbour to 13% of
// its throughput again); in all, 2,048, about 48 MiB, of the order of
// what --max-pending-calls lets a peer hold. A refusal beyond them is
// answered at once.
const (
	MaxHeldRefusalsPerCaller = 1024
	MaxHeldRefusals          = 2048
)

// The results of a refusal over its caller's budget, the values of the
// "result" attribute of idemreg.refusals.slowed.
const (
	refusalHeld = "held" // answered after RefusalDelay
	refusalFull = "full" // held slots taken: answered at once
)

// refusalLimiter holds the refusals of callers over their budget.
type refusalLimiter struct {
	limit   access.Limit
	delay   time.Duration
	buckets *access.Limiter
	slowed  metric.Int64Counter
	holding metric.Int64UpDownCounter

	mu    sync.Mutex
	held  map[string]int // by caller
	total int
}

// newRefusalLimiter returns nil, which holds nothing, when rate is not
// positive.
func newRefusalLimiter(rate float64, delay time.Duration, m *metrics) *refusalLimiter {
	if rate <= 0 {
		return nil
	}
	return &refusalLimiter{
		limit: access.Limit{Rate: rate, Burst: max(1, int(2*rate))}, delay: delay,
		buckets: access.NewLimiter(nil), slowed: m.refusalsSlowed, holding: m.refusalsHeld,
		held: map[string]int{},
	}
}

// intercept answers a refusal of a caller over its budget after the delay.
// It runs outside authentication, so that UNAUTHENTICATED is held too;
// the identity is the one authentication noted for the access log.
func (r *refusalLimiter) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	resp, err := next(ctx, req)
	if r == nil || err == nil || !sampled(status.Code(err)) {
		return resp, err
	}
	r.hold(ctx, refusalCost(ctx, err))
	return resp, err
}

// refusalByteCost is the bytes a transcoder took in for a refused request
// that cost the refusal budget one more refusal.
const refusalByteCost = 16 << 10

// requestBytesKey carries what a transcoder in front of the server took in
// for a request (WithRequestBytes).
type requestBytesKey struct{}

// WithRequestBytes notes, in the context a request reaches the server with
// (grpc.Server.ServeHTTP's), the bytes a transcoder in front of it took in
// for the request, or that its caller sent it, before the server saw it:
// a refusal of the request costs its caller's refusal budget a refusal per
// refusalByteCost of them. An HTTP caller the server does not know,
// sending 256 KiB bodies it never reads, could otherwise make a closed loop
// of them at the budget's rate of refusals, each costing the server what
// dozens of gRPC refusals cost.
func WithRequestBytes(ctx context.Context, n int64) context.Context {
	return context.WithValue(ctx, requestBytesKey{}, n)
}

// refusalCost is how many refusals of its caller's budget the refusal err
// of the request of ctx takes: one, and one per refusalByteCost of what a
// transcoder took in for it, or of the limit of a request marked too large
// (read or inflated up to the limit: more than any budget's burst, so
// always held).
func refusalCost(ctx context.Context, err error) int {
	n, _ := ctx.Value(requestBytesKey{}).(int64)
	if limit, ok := refusedTooLarge(err); ok {
		n = max(n, limit)
	}
	return 1 + int(min(n, 1<<30)/refusalByteCost)
}

// hold holds a refusal of a caller over its budget, each refusal taking
// cost of it (refusalCost): a refusal of a request too large, reading or
// inflating which up to the limit (5 MiB) costs the server what hundreds
// of other refusals cost, is held whatever the budget, where 4 callers
// sending them in a loop, within a budget counted in calls, took a
// neighbour to 6–12% of its throughput.
func (r *refusalLimiter) hold(ctx context.Context, cost int) {
	caller, by := refusedCaller(ctx)
	if ok, _ := r.buckets.AllowN(caller, r.limit, cost); ok {
		return
	}
	if !r.take(caller) {
		r.slowed.Add(ctx, 1, attrs(attribute.String("by", by), attribute.String("result", refusalFull)))
		return
	}
	defer r.give(caller)
	r.slowed.Add(ctx, 1, attrs(attribute.String("by", by), attribute.String("result", refusalHeld)))
	r.holding.Add(ctx, 1)
	defer r.holding.Add(ctx, -1)
	d := r.delay
	if dl, ok := ctx.Deadline(); ok {
		// The caller gets its refusal, not DEADLINE_EXCEEDED: a client
		// that reads the reason learns what to fix.
		d = min(d, time.Until(dl)/2)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

func (r *refusalLimiter) take(caller string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.total >= MaxHeldRefusals || r.held[caller] >= MaxHeldRefusalsPerCaller {
		return false
	}
	r.total++
	r.held[caller]++
	return true
}

func (r *refusalLimiter) give(caller string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total--
	if r.held[caller]--; r.held[caller] == 0 {
		delete(r.held, caller)
	}
}

// refusedCaller is the budget a refusal takes from: its identity's, or its
// source address's when it has none.
func refusedCaller(ctx context.Context) (caller, by string) {
	if cl, ok := ctx.Value(callLogKey{}).(*callLog); ok && cl.identity != "" && cl.identity != access.Anonymous.Name {
		return "identity:" + cl.identity, "identity"
	}
	source := ""
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		source = p.Addr.String()
		if host, _, err := net.SplitHostPort(source); err == nil {
			source = host
		}
	}
	return "source:" + source, "source"
}
