// Package httpserve serves the binary's HTTP listeners (metrics, console,
// pprof) under bounds: anyone who reaches them can connect before any
// sign-in, so each caps its connections, its timeouts and its headers.
package httpserve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// Bounds bound each of serve's HTTP listeners (metrics, console,
// pprof), which anyone who reaches them can connect to before any
// sign-in: unbounded, 5,000 idle connections took a replica from 44 to
// 138 MB, and a form's body sent a byte at a time was never cut.
type Bounds struct {
	// MaxConnections bounds the connections each listener holds open; at
	// it, a new connection takes the place of one without a request in
	// progress, or is closed as soon as it is accepted if there is none.
	MaxConnections int
	// MaxConnectionsPerSource bounds those of one source address, the
	// same way, so that one source cannot take every connection of a
	// listener from the others.
	MaxConnectionsPerSource int
	// MaxConnectionAge bounds how long a kept-alive connection is reused:
	// one idle past it is closed (each request renews IdleTimeout).
	MaxConnectionAge time.Duration
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
// A source may hold a quarter of a listener's connections, so that it
// takes four to shut the others out: one proxy, ingress or NAT in front
// still has 16 requests in progress at once, and its idle connections make
// room for its new ones. Two minutes keep a busy client's connection
// through many requests.
func DefaultBounds() Bounds {
	return Bounds{
		MaxConnections:          64,
		MaxConnectionsPerSource: 16,
		MaxConnectionAge:        2 * time.Minute,
		ReadHeaderTimeout:       5 * time.Second,
		ReadTimeout:             10 * time.Second,
		WriteTimeout:            60 * time.Second,
		IdleTimeout:             60 * time.Second,
		MaxHeaderBytes:          16 << 10,
	}
}

// Validate refuses a bound that is not positive, naming serve's flags.
func (b Bounds) Validate() error {
	if b.MaxConnections <= 0 || b.MaxConnectionsPerSource <= 0 || b.MaxConnectionAge <= 0 || b.ReadHeaderTimeout <= 0 || b.ReadTimeout <= 0 || b.WriteTimeout <= 0 || b.IdleTimeout <= 0 || b.MaxHeaderBytes <= 0 {
		return fmt.Errorf("--http-max-connections (%d), --http-max-connections-per-source (%d), --http-max-connection-age (%v), --http-read-header-timeout (%v), --http-read-timeout (%v), --http-write-timeout (%v), --http-idle-timeout (%v) and --http-max-header-bytes (%d) must be positive",
			b.MaxConnections, b.MaxConnectionsPerSource, b.MaxConnectionAge, b.ReadHeaderTimeout, b.ReadTimeout, b.WriteTimeout, b.IdleTimeout, b.MaxHeaderBytes)
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
	capped := capConnections(lis, bounds)
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: bounds.ReadHeaderTimeout,
		ReadTimeout:       bounds.ReadTimeout,
		WriteTimeout:      bounds.WriteTimeout,
		IdleTimeout:       bounds.IdleTimeout,
		MaxHeaderBytes:    bounds.MaxHeaderBytes,
		ConnState:         capped.ConnState,
		ErrorLog:          slog.NewLogLogger(logger.With("listener", name).Handler(), slog.LevelDebug),
	}
	go func() {
		if err := srv.Serve(capped); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("listener failed", "listener", name, "error", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, lis.Addr(), nil
}

// capListener caps the connections a listener holds open, and those of
// one source address (Bounds.MaxConnectionsPerSource), so that one source
// cannot shut the others out. At a cap it makes room by closing a
// connection that has no request in progress (idle between requests, or
// new and silent: ConnState tells them apart) rather than refusing the new
// caller: at the source's own cap one of that source's, at the listener's
// the one idle longest of the source holding the most. Only when every
// connection concerned has a request in progress is the new one closed at
// once: unlike a listener whose Accept waits (server.Bounds.MaxConnections),
// that tells a scraper or a browser at once that the listener is full, and
// an attacker's connections cost a file descriptor for a moment, not a
// goroutine and buffers.
//
// A connection idle after MaxConnectionAge is closed, so that a request
// now and then cannot keep it open for ever.
type capListener struct {
	net.Listener
	max, perSource int
	maxAge         time.Duration

	mu      sync.Mutex
	conns   map[*cappedConn]struct{}
	sources map[string]int
}

func capConnections(l net.Listener, b Bounds) *capListener {
	return &capListener{Listener: l, max: b.MaxConnections, perSource: min(b.MaxConnectionsPerSource, b.MaxConnections),
		maxAge: b.MaxConnectionAge, conns: map[*cappedConn]struct{}{}, sources: map[string]int{}}
}

// Capped is a listener under Bounds' connection caps; its ConnState must
// be the http.Server's, which tells it which connections are idle.
type Capped interface {
	net.Listener
	ConnState(net.Conn, http.ConnState)
}

// CapConnections is the cap Serve puts on its listener, for a listener
// served by an http.Server of its own (the HTTP API on the gRPC port, which
// sets up TLS after the cap); the server's ConnState must be the
// listener's.
func CapConnections(l net.Listener, b Bounds) Capped { return capConnections(l, b) }

// Source is the source of a connection that per-source caps count: its
// remote IP address (a NAT or a proxy in front is one source).
func Source(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cc := &cappedConn{Conn: c, l: l, source: Source(c.RemoteAddr()), opened: time.Now(), idle: true}
		cc.idleSince = cc.opened
		l.mu.Lock()
		var evict *cappedConn
		admit := true
		switch {
		case l.sources[cc.source] >= l.perSource:
			evict = l.idlest(func(o *cappedConn) bool { return o.source == cc.source })
			admit = evict != nil
		case len(l.conns) >= l.max:
			most := 0
			for o := range l.conns {
				if o.idle {
					most = max(most, l.sources[o.source])
				}
			}
			evict = l.idlest(func(o *cappedConn) bool { return l.sources[o.source] == most })
			admit = evict != nil
		}
		if evict != nil {
			l.forget(evict)
		}
		if admit {
			l.conns[cc] = struct{}{}
			l.sources[cc.source]++
		}
		l.mu.Unlock()
		if evict != nil {
			_ = evict.Conn.Close() // its server sees the read fail, and lets it go
		}
		if !admit {
			_ = c.Close()
			continue
		}
		return cc, nil
	}
}

// idlest is the connection without a request in progress, of those that
// match, that has been so the longest; nil if none. l.mu is held.
func (l *capListener) idlest(match func(*cappedConn) bool) *cappedConn {
	var out *cappedConn
	for o := range l.conns {
		if o.idle && match(o) && (out == nil || o.idleSince.Before(out.idleSince)) {
			out = o
		}
	}
	return out
}

// forget gives c's slots back, once. l.mu is held.
func (l *capListener) forget(c *cappedConn) {
	if _, ok := l.conns[c]; !ok {
		return
	}
	delete(l.conns, c)
	if l.sources[c.source]--; l.sources[c.source] <= 0 {
		delete(l.sources, c.source)
	}
}

// ConnState follows which connections have a request in progress, and
// closes one that turns idle past its age.
func (l *capListener) ConnState(c net.Conn, s http.ConnState) {
	raw := c
	if t, ok := c.(*tls.Conn); ok {
		raw = t.NetConn()
	}
	cc, ok := raw.(*cappedConn)
	if !ok {
		return
	}
	l.mu.Lock()
	switch s {
	case http.StateActive:
		cc.idle = false
	case http.StateIdle:
		cc.idle, cc.idleSince = true, time.Now()
	}
	old := s == http.StateIdle && l.maxAge > 0 && time.Since(cc.opened) >= l.maxAge
	l.mu.Unlock()
	if old {
		_ = c.Close()
	}
}

type cappedConn struct {
	net.Conn
	l      *capListener
	source string
	opened time.Time
	// idle (no request in progress) and idleSince are guarded by l.mu.
	idle      bool
	idleSince time.Time
}

func (c *cappedConn) Close() error {
	err := c.Conn.Close()
	c.l.mu.Lock()
	c.l.forget(c)
	c.l.mu.Unlock()
	return err
}
