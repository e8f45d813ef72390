package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// Bounds are what anyone who can open a connection may make the server
// hold, before any credential is checked: HTTP/2 header lists, streams,
// connections, and the long-lived streams that need no credentials (health
// Watch, reflection). grpc-go's own defaults leave them unbounded (16 MiB
// of headers per stream, streams without number), which let forty health
// streams take a server from 51 MB to 407 MB. Zero fields take the
// defaults below.
//
// A call whose request never arrives keeps a goroutine and its headers
// until its connection closes, recycled at least every MaxConnectionAge
// (Keepalive); MaxPendingCalls bounds how many such calls both listeners
// hold together, whatever MaxConnections × MaxConcurrentStreams allow.
type Bounds struct {
	// MaxHeaderListSize bounds the header list of one stream (HTTP/2
	// SETTINGS_MAX_HEADER_LIST_SIZE, names and values plus 32 bytes per
	// field); a stream over it is reset before it reaches a handler
	// (DefaultMaxHeaderListSize).
	MaxHeaderListSize uint32
	// MaxConcurrentStreams bounds the streams (calls) open at once on one
	// connection; a stream beyond it is refused (REFUSED_STREAM), and gRPC
	// clients queue calls beyond it instead of sending them
	// (DefaultMaxConcurrentStreams).
	MaxConcurrentStreams uint32
	// MaxConnections bounds the connections a listener holds open at once;
	// beyond it, new connections wait in the kernel's accept queue until
	// one closes (DefaultMaxConnections). Each listener (gRPC, health) has
	// its own count.
	MaxConnections int
	// MaxPublicStreams bounds the streaming calls open at once that need
	// no credentials (health Watch and reflection), over every connection
	// and both listeners; one beyond it fails at once with
	// RESOURCE_EXHAUSTED, reason TOO_MANY_STREAMS (DefaultMaxPublicStreams).
	MaxPublicStreams int
	// ConnectionTimeout bounds a new connection's TLS and HTTP/2
	// handshakes, so that a peer that connects and sends nothing does not
	// keep a connection slot (DefaultConnectionTimeout).
	ConnectionTimeout time.Duration
	// MaxCallsPerIdentity bounds the calls of one identity in progress at
	// once, over every connection, so that one caller cannot take every
	// store slot (Config.MaxInFlight) from the others; a call beyond it
	// fails at once with RESOURCE_EXHAUSTED, reason TOO_MANY_CALLS
	// (DefaultMaxCallsPerIdentity). It applies when the server has
	// identities; anonymous callers of an open server are one caller.
	MaxCallsPerIdentity int
	// MaxHealthConnectionsPerSource bounds the connections one source
	// address holds open on the health listener; a new one beyond it is
	// closed at once, so that a flood from one source cannot take every
	// slot of MaxConnections from the kubelet's probes, which come from
	// the node's address (DefaultMaxHealthConnectionsPerSource; at most
	// MaxConnections).
	MaxHealthConnectionsPerSource int
	// MaxPendingCalls bounds the calls whose request message has not
	// arrived whole yet, over both listeners: each (gRPC, health) holds at
	// most half, so that a flood of one leaves the other its share. A call
	// beyond it fails at once, before any credential is checked, with
	// RESOURCE_EXHAUSTED, reason TOO_MANY_STREAMS
	// (DefaultMaxPendingCalls). Such a call costs its goroutine and its
	// headers (HeldCallBytes at the default header bound).
	MaxPendingCalls int
}

const (
	// DefaultMaxHeaderListSize: a call's own headers (path, content type,
	// deadline, bearer token, trace context) take well under 2 KiB; 16 KiB
	// leaves room for a caller's metadata and nothing for abuse.
	DefaultMaxHeaderListSize = 16 << 10
	// DefaultMaxConcurrentStreams: more than a client needs on one
	// connection to keep a replica's store busy (a pool holds tens of
	// connections); the bound times the header size is what one
	// connection can pin.
	DefaultMaxConcurrentStreams = 64
	// DefaultMaxConnections: a shared replica serves one connection per
	// client process behind a ClusterIP Service; 128 of them fit.
	// MaxPendingCalls bounds what their held calls pin.
	DefaultMaxConnections = 128
	// DefaultMaxHealthConnectionsPerSource: an eighth of
	// DefaultMaxConnections, so that it takes eight sources to fill the
	// health listener; a kubelet opens a connection per probe, three
	// probes at most at once.
	DefaultMaxHealthConnectionsPerSource = DefaultMaxConnections / 8
	// DefaultMaxPublicStreams: enough for the watchers and grpcurl
	// sessions of operators, far below what would matter in memory.
	DefaultMaxPublicStreams = 64
	// DefaultConnectionTimeout: a handshake on a working network takes
	// milliseconds.
	DefaultConnectionTimeout = 10 * time.Second
	// DefaultMaxCallsPerIdentity: half of DefaultMaxInFlight, so that one
	// identity at its bound leaves the other half to the rest.
	DefaultMaxCallsPerIdentity = DefaultMaxInFlight / 2
	// DefaultMaxPendingCalls: a well-behaved call sends its message with
	// its headers and is pending for microseconds, so 1024 per listener is
	// never reached by callers; at HeldCallBytes each, 2048 held calls
	// cost at most 96 MiB, under a fifth of the 512 MiB pod of deploy/
	// (without the bound, both listeners held 16,384: 797 MB).
	DefaultMaxPendingCalls = 2048
	// HeldCallBytes is the resident memory one held call costs with
	// headers at DefaultMaxHeaderListSize (a call whose headers arrived
	// and whose message never does): measured by BenchmarkHeldCalls on
	// linux/amd64 (Go 1.26, grpc-go 1.85) at 35-46 KiB (about 21 KiB of
	// heap in use and 8 KiB of goroutine stack, the rest the collector's
	// headroom), rounded up.
	HeldCallBytes = 48 << 10
)

// Smallest and largest header list sizes Validate accepts: below the
// first a call's own headers do not fit; above the second the bound is no
// bound (it is grpc-go's default).
const (
	minHeaderListSize = 1 << 10
	maxHeaderListSize = 16 << 20
)

// DefaultBounds returns the default bounds.
func DefaultBounds() Bounds {
	return Bounds{
		MaxHeaderListSize:    DefaultMaxHeaderListSize,
		MaxConcurrentStreams: DefaultMaxConcurrentStreams,
		MaxConnections:       DefaultMaxConnections,
		MaxPublicStreams:     DefaultMaxPublicStreams,
		ConnectionTimeout:    DefaultConnectionTimeout,
		MaxCallsPerIdentity:  DefaultMaxCallsPerIdentity,
		MaxPendingCalls:      DefaultMaxPendingCalls,

		MaxHealthConnectionsPerSource: DefaultMaxHealthConnectionsPerSource,
	}
}

func (b *Bounds) setDefaults() {
	d := DefaultBounds()
	if b.MaxHeaderListSize == 0 {
		b.MaxHeaderListSize = d.MaxHeaderListSize
	}
	if b.MaxConcurrentStreams == 0 {
		b.MaxConcurrentStreams = d.MaxConcurrentStreams
	}
	if b.MaxConnections == 0 {
		b.MaxConnections = d.MaxConnections
	}
	if b.MaxPublicStreams == 0 {
		b.MaxPublicStreams = d.MaxPublicStreams
	}
	if b.MaxHealthConnectionsPerSource == 0 {
		b.MaxHealthConnectionsPerSource = d.MaxHealthConnectionsPerSource
	}
	if b.ConnectionTimeout == 0 {
		b.ConnectionTimeout = d.ConnectionTimeout
	}
	if b.MaxCallsPerIdentity == 0 {
		b.MaxCallsPerIdentity = d.MaxCallsPerIdentity
	}
	if b.MaxPendingCalls == 0 {
		b.MaxPendingCalls = d.MaxPendingCalls
	}
}

// Validate reports bounds that cannot work. Zero fields are valid: they
// take the defaults.
func (b Bounds) Validate() error {
	var errs []error
	if b.MaxHeaderListSize != 0 && (b.MaxHeaderListSize < minHeaderListSize || b.MaxHeaderListSize > maxHeaderListSize) {
		errs = append(errs, fmt.Errorf("the header list bound must be between %d and %d bytes, got %d", minHeaderListSize, maxHeaderListSize, b.MaxHeaderListSize))
	}
	if b.MaxConnections < 0 {
		errs = append(errs, fmt.Errorf("the connection bound must be positive, got %d", b.MaxConnections))
	}
	if b.MaxHealthConnectionsPerSource < 0 {
		errs = append(errs, fmt.Errorf("the bound on one source's health connections must be positive, got %d", b.MaxHealthConnectionsPerSource))
	}
	if b.MaxPublicStreams < 0 {
		errs = append(errs, fmt.Errorf("the bound on streams without credentials must be positive, got %d", b.MaxPublicStreams))
	}
	if b.MaxCallsPerIdentity < 0 {
		errs = append(errs, fmt.Errorf("the bound on one identity's calls must be positive, got %d", b.MaxCallsPerIdentity))
	}
	if b.MaxPendingCalls < 0 || b.MaxPendingCalls == 1 {
		errs = append(errs, fmt.Errorf("the bound on calls waiting for their request must be at least 2 (one per listener), got %d", b.MaxPendingCalls))
	}
	if b.ConnectionTimeout < 0 {
		errs = append(errs, fmt.Errorf("the connection handshake timeout must be positive, got %v", b.ConnectionTimeout))
	}
	return errors.Join(errs...)
}

// serverOptions are the options that bound what a peer can open, for every
// gRPC server the Server runs; pending is the listener's share of the calls
// waiting for their request.
func (b Bounds) serverOptions(pending *pendingCalls) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxHeaderListSize(b.MaxHeaderListSize),
		grpc.MaxConcurrentStreams(b.MaxConcurrentStreams),
		grpc.ConnectionTimeout(b.ConnectionTimeout),
		grpc.InTapHandle(pending.tap),
		grpc.StatsHandler(pendingStats{}),
	}
}

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

func newPublicStreams(n int, m *metrics) *publicStreams {
	refused := attrs(attribute.String("bound", "public_streams"))
	return &publicStreams{slots: make(chan struct{}, n), refused: func(ctx context.Context) { m.boundRefused.Add(ctx, 1, refused) }}
}

// intercept refuses a public stream beyond the bound at once: a watcher
// that waited for a slot would hold its connection and headers anyway.
func (p *publicStreams) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	select {
	case p.slots <- struct{}{}:
	default:
		p.refused(ss.Context())
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_STREAMS, "too many streams without credentials are open; retry later", nil,
			reason.RetryInfo(unavailableRetryAfter))
	}
	defer func() { <-p.slots }()
	return handler(srv, ss)
}

// identityCalls counts the calls in progress of each identity. Entries are
// kept: there is one per identity of the config file, which is small.
type identityCalls struct {
	max   int64
	calls sync.Map // identity name → *atomic.Int64
	m     *metrics
}

// intercept refuses a call of an identity at its bound. It runs after
// authentication, so the identity is the one its credentials prove.
func (c *identityCalls) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	id, ok := IdentityFrom(ctx)
	if !ok || id == access.Anonymous {
		return next(ctx, req)
	}
	v, _ := c.calls.LoadOrStore(id.Name, new(atomic.Int64))
	n := v.(*atomic.Int64)
	defer n.Add(-1)
	if n.Add(1) > c.max {
		c.m.boundRefused.Add(ctx, 1, attrs(attribute.String("bound", "identity_calls"), attribute.String("identity", id.Name)))
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_CALLS,
			"identity "+quote(id.Name)+" has too many calls in progress; retry later",
			map[string]string{"identity": id.Name},
			&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
				Subject:     "identity:" + id.Name,
				Description: fmt.Sprintf("%d calls in progress", c.max),
			}}},
			reason.RetryInfo(overloadedRetryAfter))
	}
	return next(ctx, req)
}
