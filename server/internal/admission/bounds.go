package admission

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// limitListener holds at most n connections open at once: Accept waits for
// one to close. Waiting, rather than accepting and closing at once, keeps
// the excess in the kernel's queue, where it costs the process nothing,
// and serves it as soon as there is room.
type limitListener struct {
	net.Listener
	slots chan struct{}
	// conns is the connections open; slots also holds the one Accept
	// waits for.
	conns atomic.Int64
	// closed ends the waits of Accept when the listener closes.
	closed    chan struct{}
	closeOnce sync.Once
}

func limitConnections(l net.Listener, n int) *limitListener {
	return &limitListener{Listener: l, slots: make(chan struct{}, n), closed: make(chan struct{})}
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	l.conns.Add(1)
	return &limitedConn{Conn: c, release: func() { l.conns.Add(-1); <-l.slots }}, nil
}

// open is the number of connections open now.
func (l *limitListener) open() int64 { return l.conns.Load() }

func (l *limitListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// sourceLimitListener closes at once a connection whose source address
// (its IP) holds n open already. Under a limitListener, such a connection
// takes its slot only for a moment: a flood from one source leaves the
// others the rest.
type sourceLimitListener struct {
	net.Listener
	n       int
	mu      sync.Mutex
	sources map[string]int
}

func limitSources(l net.Listener, n int) *sourceLimitListener {
	return &sourceLimitListener{Listener: l, n: n, sources: map[string]int{}}
}

func (l *sourceLimitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		src := sourceIP(c.RemoteAddr())
		l.mu.Lock()
		admit := l.sources[src] < l.n
		if admit {
			l.sources[src]++
		}
		l.mu.Unlock()
		if !admit {
			_ = c.Close()
			continue
		}
		return &limitedConn{Conn: c, release: func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.sources[src]--; l.sources[src] <= 0 {
				delete(l.sources, src)
			}
		}}, nil
	}
}

// sourceIP is the source a per-source bound counts: the remote IP (a NAT
// or a proxy in front is one source).
func sourceIP(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}

// publicStreams bounds the streaming calls that need no credentials.
type publicStreams struct {
	slots   chan struct{}
	refused func(context.Context)
}

// intercept refuses a public stream beyond the bound at once: a watcher
// that waited for a slot would hold its connection and headers anyway.
func (p *publicStreams) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	select {
	case p.slots <- struct{}{}:
	default:
		p.refused(ss.Context())
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_STREAMS, "too many streams without credentials are open; retry later", nil,
			reason.RetryInfo(streamsRetryAfter))
	}
	defer func() { <-p.slots }()
	return handler(srv, ss)
}

// identityCalls counts the calls in progress of each identity. Entries are
// kept: there is one per identity of the config file, which is small.
type identityCalls struct {
	max     int64
	calls   sync.Map // identity name → *atomic.Int64
	tenant  func(context.Context) string
	refused metric.Int64Counter
}

// intercept refuses a call of an identity at its bound. It runs after
// authentication, so the identity is the one its credentials prove.
func (c *identityCalls) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	name := c.tenant(ctx)
	if name == "" {
		return next(ctx, req)
	}
	v, _ := c.calls.LoadOrStore(name, new(atomic.Int64))
	n := v.(*atomic.Int64)
	defer n.Add(-1)
	if n.Add(1) > c.max {
		c.refused.Add(ctx, 1, attrs(attribute.String("bound", BoundIdentityCalls), attribute.String("identity", name)))
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_CALLS,
			"identity \""+name+"\" has too many calls in progress; retry later",
			map[string]string{"identity": name},
			&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
				Subject:     "identity:" + name,
				Description: fmt.Sprintf("%d calls in progress", c.max),
			}}},
			reason.RetryInfo(callsRetryAfter))
	}
	return next(ctx, req)
}
