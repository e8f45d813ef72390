// Package httpserve serves the binary's HTTP listeners (metrics, console,
// pprof) under bounds: anyone who reaches them can connect before any
// sign-in, so each caps its connections, its timeouts and its headers.
package httpserve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Bounds bound each of serve's HTTP listeners (metrics, console,
// pprof), which anyone who reaches them can connect to before any
// sign-in: unbounded, 5,000 idle connections took a replica from 44 to
// 138 MB, and a form's body sent a byte at a time was never cut.
type Bounds struct {
	// MaxConnections bounds the connections each listener holds open; one
	// beyond it is closed as soon as it is accepted.
	MaxConnections int
	// ReadHeaderTimeout bounds reading a request's headers (and a new
	// connection's wait for its first request); ReadTimeout the whole
	// request, body included; WriteTimeout the time from the end of
	// the headers to the end of the response (a pprof profile or trace
	// asks for at most this long); IdleTimeout a kept-alive connection's
	// wait for its next request.
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's headers.
	MaxHeaderBytes int
}

// DefaultBounds are the defaults of Bounds: a Prometheus server, a few operators' browsers
// and a profiler need a handful of connections each; a scrape or a page
// takes milliseconds to send; a page's gRPC calls take at most the
// console's call timeout (10 s) each, and a CPU profile 30 s by default.
func DefaultBounds() Bounds {
	return Bounds{
		MaxConnections:    64,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      60 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
	}
}

// Validate refuses a bound that is not positive, naming serve's flags.
func (b Bounds) Validate() error {
	if b.MaxConnections <= 0 || b.ReadHeaderTimeout <= 0 || b.ReadTimeout <= 0 || b.WriteTimeout <= 0 || b.IdleTimeout <= 0 || b.MaxHeaderBytes <= 0 {
		return fmt.Errorf("--http-max-connections (%d), --http-read-header-timeout (%v), --http-read-timeout (%v), --http-write-timeout (%v), --http-idle-timeout (%v) and --http-max-header-bytes (%d) must be positive",
			b.MaxConnections, b.ReadHeaderTimeout, b.ReadTimeout, b.WriteTimeout, b.IdleTimeout, b.MaxHeaderBytes)
	}
	return nil
}

// Serve serves h on addr, under bounds, until the returned function is
// called; name says which listener in errors and logs.
func Serve(name, addr string, h http.Handler, bounds Bounds, logger *slog.Logger) (stop func(), bound net.Addr, err error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: listening on %s: %w", name, addr, err)
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: bounds.ReadHeaderTimeout,
		ReadTimeout:       bounds.ReadTimeout,
		WriteTimeout:      bounds.WriteTimeout,
		IdleTimeout:       bounds.IdleTimeout,
		MaxHeaderBytes:    bounds.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.With("listener", name).Handler(), slog.LevelDebug),
	}
	go func() {
		if err := srv.Serve(capConnections(lis, bounds.MaxConnections)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("listener failed", "listener", name, "error", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, lis.Addr(), nil
}

// capListener closes a connection accepted beyond its cap at once. Unlike
// a listener whose Accept waits (server.Bounds.MaxConnections), it tells a
// scraper or a browser at once that the listener is full, and an
// attacker's connections cost a file descriptor for a moment, not a
// goroutine and buffers.
type capListener struct {
	net.Listener
	open atomic.Int64
	max  int64
}

func capConnections(l net.Listener, n int) *capListener {
	return &capListener{Listener: l, max: int64(n)}
}

// CapConnections is the cap Serve puts on its listener, for a listener
// served by an http.Server of its own (the HTTP API on the gRPC port, which
// sets up TLS after the cap).
func CapConnections(l net.Listener, n int) net.Listener { return capConnections(l, n) }

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > l.max {
			l.open.Add(-1)
			_ = c.Close()
			continue
		}
		return &cappedConn{Conn: c, l: l}, nil
	}
}

type cappedConn struct {
	net.Conn
	l    *capListener
	once sync.Once
}

func (c *cappedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.open.Add(-1) })
	return err
}
