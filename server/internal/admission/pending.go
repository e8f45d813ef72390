package admission

import (
	"context"
	"sync"

	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/tap"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// pendingCalls bounds the calls of one listener whose request message has
// not arrived yet: what a peer that sends headers and never a message makes
// the server hold, before any credential is checked (a goroutine, its
// stack and the decoded headers: about 30 KiB a call at the header bound,
// 35-46 KiB of resident memory; BenchmarkHeldCalls). MaxConcurrentStreams
// and MaxConnections alone let a peer hold 128 × 64 of them on each
// listener, 800 MB between the two. A call takes a slot when its headers
// arrive (the transport's tap, before a handler or a stream goroutine
// exists) and gives it back when its first message has arrived whole or
// the call ends, whichever is first.
type pendingCalls struct {
	// slots is the listener's share of MaxPendingCalls.
	slots   chan struct{}
	refused func(ctx context.Context)
}

func newPendingCalls(n int, refused func(context.Context)) *pendingCalls {
	return &pendingCalls{slots: make(chan struct{}, n), refused: refused}
}

type callPendingKey struct{}

// tap is the transport's grpc.InTapHandle: it runs on the connection's
// reader as each call's headers arrive, so it must not block. A call it
// refuses is answered with its status and never reaches a handler.
func (p *pendingCalls) tap(ctx context.Context, _ *tap.Info) (context.Context, error) {
	select {
	case p.slots <- struct{}{}:
	default:
		p.refused(ctx)
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_STREAMS,
			"too many calls are waiting for their request message; retry later", nil, reason.RetryInfo(streamsRetryAfter))
	}
	release := sync.OnceFunc(func() { <-p.slots })
	// The transport cancels the call's context when the call ends, however
	// it ends (a status sent, a reset, the connection closed).
	stop := context.AfterFunc(ctx, release)
	received := func() {
		stop()
		release()
	}
	return context.WithValue(ctx, callPendingKey{}, received), nil
}

// pendingStats is the stats handler that gives a call's slot back when its
// first message has arrived.
type pendingStats struct{}

func (pendingStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (pendingStats) HandleConn(context.Context, stats.ConnStats) {}

func (pendingStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (pendingStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.InPayload); !ok {
		return
	}
	if received, ok := ctx.Value(callPendingKey{}).(func()); ok {
		received()
	}
}
