// Package admission owns what a replica admits before a request's handler
// has read anything, and what it makes a peer that can merely connect
// hold: connections per listener and per source address (bounds.go), calls
// whose request has not arrived (pending.go), streams that need no
// credentials and calls in progress per identity (bounds.go), and the
// memory guard that refuses Claims near the memory limit (memory.go). It
// owns their instruments: idemreg.bounds.refused and idemreg.connections.
//
// The server (package server) turns its Bounds into a Config, wraps its
// listeners with Listen, adds ServerOptions to each gRPC server, puts
// PublicStream and CallsPerIdentity in its interceptor chains, runs Run
// while serving and asks RefuseClaim before a Claim starts work.
package admission

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
)

// Instrument names, in the server's scope (docs/operations.md).
const (
	MetricBoundRefused = "idemreg.bounds.refused"
	MetricConnections  = "idemreg.connections"
)

// Values of the "bound" attribute of idemreg.bounds.refused.
const (
	BoundPublicStreams = "public_streams"
	BoundPendingCalls  = "pending_calls"
	BoundIdentityCalls = "identity_calls"
)

// Listeners, the values of the "listener" attribute of idemreg.connections.
const (
	ListenerGRPC   = "grpc"
	ListenerHealth = "health"
)

// RetryInfo delays of the refusals: a held call or stream frees its slot
// in about a second (the server's delay for UNAVAILABLE), a call of an
// identity in a few milliseconds (the delay for OVERLOADED).
const (
	streamsRetryAfter = time.Second
	callsRetryAfter   = 100 * time.Millisecond
)

// Config is the bounds, already defaulted and validated (server.Bounds).
type Config struct {
	// MaxHeaderListSize, MaxConcurrentStreams and ConnectionTimeout are
	// the transport's bounds, given to every gRPC server (ServerOptions).
	MaxHeaderListSize    uint32
	MaxConcurrentStreams uint32
	ConnectionTimeout    time.Duration
	// MaxConnections bounds each listener's connections;
	// MaxHealthConnectionsPerSource one source's on the health listener.
	MaxConnections, MaxHealthConnectionsPerSource int
	// MaxPublicStreams bounds the streams without credentials over both
	// listeners; MaxCallsPerIdentity one identity's calls in progress;
	// MaxPendingCalls the calls without their request over both listeners
	// (half each, the odd one to gRPC's).
	MaxPublicStreams, MaxCallsPerIdentity, MaxPendingCalls int
	// Tenant is the identity whose share a call of ctx takes, empty for
	// none (the anonymous caller of an open server is every caller, not a
	// tenant): its calls are not bounded per identity.
	Tenant func(ctx context.Context) string
	// Meter makes the instruments; Logger receives the memory guard's
	// changes of level (nil discards them).
	Meter  metric.Meter
	Logger *slog.Logger
}

// Admission admits connections, calls and Claims under Config's bounds.
// It is safe for concurrent use.
type Admission struct {
	cfg     Config
	refused metric.Int64Counter
	// pending are the listeners' shares of MaxPendingCalls.
	pending map[string]*pendingCalls
	public  *publicStreams
	calls   *identityCalls
	memory  *memoryGuard
	// listeners are the bounded listeners, by name, once serving: read by
	// the connections gauge.
	listeners sync.Map // ListenerGRPC, ListenerHealth → *limitListener
}

// New returns the admission of cfg, its instruments made and the series
// of idemreg.bounds.refused at zero (an alert on rate() sees them from the
// start).
func New(cfg Config) (*Admission, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Tenant == nil {
		cfg.Tenant = func(context.Context) string { return "" }
	}
	m := cfg.Meter
	refused, err := m.Int64Counter(MetricBoundRefused, metric.WithUnit("{call}"),
		metric.WithDescription("Calls refused by a bound of server.Bounds, by bound: public_streams or pending_calls (TOO_MANY_STREAMS), or identity_calls (TOO_MANY_CALLS)."))
	if err != nil {
		return nil, fmt.Errorf("admission: metrics: %w", err)
	}
	connections, err := m.Int64ObservableUpDownCounter(MetricConnections, metric.WithUnit("{connection}"),
		metric.WithDescription("Connections open, by listener (grpc, health); each is bounded by MaxConnections."))
	if err != nil {
		return nil, fmt.Errorf("admission: metrics: %w", err)
	}
	a := &Admission{cfg: cfg, refused: refused, memory: &memoryGuard{logger: cfg.Logger}}
	a.pending = map[string]*pendingCalls{
		ListenerGRPC:   newPendingCalls(cfg.MaxPendingCalls-cfg.MaxPendingCalls/2, a.counter(BoundPendingCalls)),
		ListenerHealth: newPendingCalls(cfg.MaxPendingCalls/2, a.counter(BoundPendingCalls)),
	}
	a.public = &publicStreams{slots: make(chan struct{}, cfg.MaxPublicStreams), refused: a.counter(BoundPublicStreams)}
	a.calls = &identityCalls{max: int64(cfg.MaxCallsPerIdentity), tenant: cfg.Tenant, refused: refused}
	if _, err := m.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		a.listeners.Range(func(name, l any) bool {
			obs.ObserveInt64(connections, l.(*limitListener).open(), metric.WithAttributes(attribute.String("listener", name.(string))))
			return true
		})
		return nil
	}, connections); err != nil {
		return nil, fmt.Errorf("admission: metrics: %w", err)
	}
	for _, b := range []string{BoundPublicStreams, BoundPendingCalls, BoundIdentityCalls} {
		refused.Add(context.Background(), 0, attrs(attribute.String("bound", b)))
	}
	return a, nil
}

// counter counts a refusal by bound, its attributes built once.
func (a *Admission) counter(bound string) func(context.Context) {
	o := attrs(attribute.String("bound", bound))
	return func(ctx context.Context) { a.refused.Add(ctx, 1, o) }
}

func attrs(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(kv...))
}

// ServerOptions are the options that bound what a peer can open on the
// listener named (ListenerGRPC or ListenerHealth): the header list, the
// streams per connection, the handshake's time, and the listener's share
// of the calls waiting for their request.
func (a *Admission) ServerOptions(listener string) []grpc.ServerOption {
	p, ok := a.pending[listener]
	if !ok {
		panic("admission: no listener " + listener)
	}
	return []grpc.ServerOption{
		grpc.MaxHeaderListSize(a.cfg.MaxHeaderListSize),
		grpc.MaxConcurrentStreams(a.cfg.MaxConcurrentStreams),
		grpc.ConnectionTimeout(a.cfg.ConnectionTimeout),
		grpc.InTapHandle(p.tap),
		grpc.StatsHandler(pendingStats{}),
	}
}

// Listen bounds the connections of the listener named (ListenerGRPC or
// ListenerHealth) and shows their number in the connections gauge; the
// health listener's are also bounded per source address.
func (a *Admission) Listen(name string, lis net.Listener) net.Listener {
	if name == ListenerHealth {
		lis = limitSources(lis, min(a.cfg.MaxHealthConnectionsPerSource, a.cfg.MaxConnections))
	}
	l := limitConnections(lis, a.cfg.MaxConnections)
	a.listeners.Store(name, l)
	return l
}

// PublicStream is the stream interceptor of the methods that need no
// credentials (health's Watch, reflection): one beyond MaxPublicStreams
// fails at once.
func (a *Admission) PublicStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return a.public.intercept(srv, ss, info, handler)
}

// CallsPerIdentity is the unary interceptor that refuses a call of an
// identity with MaxCallsPerIdentity calls in progress. It runs after
// authentication, so the identity is the one its credentials prove.
func (a *Admission) CallsPerIdentity(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	return a.calls.intercept(ctx, req, info, next)
}

// Run watches the memory until ctx ends.
func (a *Admission) Run(ctx context.Context) { a.memory.run(ctx) }

// RefuseClaim is the refusal of a Claim while the live heap is near the
// memory limit (storage.ExhaustedError, resource memory), nil otherwise
// and on a nil Admission.
func (a *Admission) RefuseClaim() error {
	if a == nil {
		return nil
	}
	return a.memory.refuse()
}
