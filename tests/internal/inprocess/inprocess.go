// Package inprocess runs a real idemreg registry inside a test process:
// the registry's gRPC server on a loopback listener, over the embedded
// store in memory, and a client connected to it. It is what
// client/registrytest was before that package ran the idemreg binary
// (issue 39), kept for the tests of the client (tests/client), which move
// the store's clock (WithClock) and close the store under a running
// server (StopStore): neither reaches a registry in another process.
package inprocess

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// Clock is a clock that tests move forward: pass its Now to WithClock and
// call Advance to step past leases and retention windows without sleeping.
// The zero value reads the real time.
type Clock = storagetest.Clock

// Limits are the registry's request bounds and defaults; DefaultLimits
// returns the registry's defaults.
type Limits = server.Limits

// DefaultLimits returns the limits of a registry started without WithLimits.
func DefaultLimits() Limits { return server.DefaultLimits() }

// Option configures New and Start.
type Option func(*config)

type config struct {
	limits     server.Limits
	now        func() time.Time
	logger     *slog.Logger
	clientOpts []client.ClientOption
	addr       string
}

// WithLimits sets the registry's limits (default DefaultLimits()), for
// instance a MinLease below a second so a test can let leases run out fast.
func WithLimits(l Limits) Option { return func(c *config) { c.limits = l } }

// WithClock sets the registry store's clock (default time.Now).
func WithClock(now func() time.Time) Option { return func(c *config) { c.now = now } }

// WithLogger receives the registry's logs (default: discarded).
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithClientOptions configures the Client of the Registry.
func WithClientOptions(opts ...client.ClientOption) Option {
	return func(c *config) { c.clientOpts = append(c.clientOpts, opts...) }
}

// WithAddress sets the listen address (default "127.0.0.1:0", a free port).
func WithAddress(addr string) Option { return func(c *config) { c.addr = addr } }

// Registry is a running registry and a client connected to it.
type Registry struct {
	// Addr is the host:port the registry listens on, for other processes.
	Addr string
	// Conn is connected to the registry; it stays open after Stop.
	Conn *grpc.ClientConn
	// Client is a client.Client on Conn.
	Client *client.Client

	store    *pebble.Store
	cancel   context.CancelFunc
	served   chan error
	stopOnce sync.Once
	stopErr  error
	closed   sync.Once
	closeErr error
}

// New starts a registry. Close it when done.
func New(opts ...Option) (*Registry, error) {
	cfg := config{limits: server.DefaultLimits(), now: time.Now, logger: slog.New(slog.DiscardHandler), addr: "127.0.0.1:0"}
	for _, o := range opts {
		o(&cfg)
	}
	store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithClock(cfg.now), pebble.WithLogger(cfg.logger))
	if err != nil {
		return nil, fmt.Errorf("inprocess: open store: %w", err)
	}
	srv, err := server.New(store, server.Config{
		Limits:          cfg.limits,
		Logger:          cfg.logger,
		ShutdownTimeout: time.Second,
	})
	if err != nil {
		_ = store.Close()
		return nil, fmt.Errorf("inprocess: %w", err)
	}
	lis, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		_ = store.Close()
		return nil, fmt.Errorf("inprocess: listen: %w", err)
	}
	addr := lis.Addr().String()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		_ = lis.Close()
		_ = store.Close()
		return nil, fmt.Errorf("inprocess: dial: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Registry{
		Addr:   addr,
		Conn:   conn,
		Client: client.New(conn, cfg.clientOpts...),
		store:  store,
		cancel: cancel,
		served: make(chan error, 1),
	}
	go func() { r.served <- srv.Serve(ctx, lis) }()
	return r, nil
}

// Start starts a registry for the test and closes it when the test ends.
func Start(t testing.TB, opts ...Option) *Registry {
	t.Helper()
	r, err := New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("inprocess: close: %v", err)
		}
	})
	return r
}

// Stop stops the registry's server, as if the registry went down: Conn stays
// open and calls through it fail with UNAVAILABLE. It is safe to call more
// than once.
func (r *Registry) Stop() error {
	r.stopOnce.Do(func() {
		r.cancel()
		r.stopErr = <-r.served
	})
	return r.stopErr
}

// StopStore closes the store under the running server, as if the
// registry's database went down: the server still answers, and every call
// fails with UNAVAILABLE, reason STORE_UNAVAILABLE and a RetryInfo (a
// client.UnavailableError with RetryAfter set). It cannot be undone.
func (r *Registry) StopStore() error { return r.store.Close() }

// Close stops the server and releases the connection and the store. It is
// safe to call more than once.
func (r *Registry) Close() error {
	r.closed.Do(func() {
		r.closeErr = errors.Join(r.Stop(), r.Conn.Close(), r.store.Close())
	})
	return r.closeErr
}
