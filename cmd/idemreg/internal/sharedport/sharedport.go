// Package sharedport makes the gRPC port also answer the Connect protocol
// (JSON and binary), gRPC-Web and so plain HTTP/JSON (a Connect unary call
// is a POST of JSON), for browsers and curl. The gRPC path is left as it
// was: each connection is told apart once, when it opens, and a gRPC
// connection goes on to grpc-go's own HTTP/2 transport, with its TLS,
// bounds and interceptors. The others go to an http.Server whose handler is
// vanguard's transcoder over the same grpc.Server (grpc.Server.ServeHTTP),
// so the same interceptors (authentication, authorisation, rate limits,
// quotas, metrics, the access log) answer them, with the same error
// details, which vanguard sends as the Connect protocol's JSON error.
//
// How a connection is told apart, without a byte of the gRPC path changed:
//   - plaintext: a connection that opens with HTTP/2's client preface
//     (gRPC, h2c) is gRPC's; any other (HTTP/1.1) is the HTTP API's;
//   - TLS: the ClientHello is read, not answered, and a client that offers
//     http/1.1 among its ALPN protocols (browsers, curl, fetch) is the HTTP
//     API's, where it negotiates http/1.1; one that offers only h2 (every
//     gRPC client) is gRPC's, whose own TLS handshake then reads the same
//     ClientHello.
//
// So the HTTP API speaks HTTP/1.1. A Connect client that insists on HTTP/2
// (connect-go or connect-node with HTTP/2 and the Connect protocol) reaches
// grpc-go, which refuses it: such a client uses the gRPC protocol instead.
package sharedport

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
)

// MaxSniffing bounds the opened connections being told apart at once (each
// for at most Split's timeout).
const MaxSniffing = 256

// DefaultMaxSniffingPerSource is the default share of MaxSniffing one
// source address may hold: a quarter, so that it takes four sources that
// connect and send nothing to keep the others from connecting, while a
// proxy or a NAT in front, whose clients send their first bytes at once,
// is never near it.
const DefaultMaxSniffingPerSource = MaxSniffing / 4

// SplitOption configures Split.
type SplitOption func(*portSplit)

// WithMaxSniffingPerSource bounds the connections of one source address
// (httpserve.Source) being told apart at once (DefaultMaxSniffingPerSource;
// at most MaxSniffing): a new one beyond it is closed at once, so that a
// source that connects and sends nothing cannot keep the others waiting
// for the timeout.
func WithMaxSniffingPerSource(n int) SplitOption {
	return func(p *portSplit) { p.perSource = min(n, MaxSniffing) }
}

// Split accepts on lis and hands each connection to the gRPC side or
// to the HTTP side. tlsCfg is the gRPC server's TLS configuration, nil for
// plaintext. Closing either returned listener closes lis.
func Split(lis net.Listener, tlsCfg *tls.Config, timeout time.Duration, logger *slog.Logger, opts ...SplitOption) (grpcSide, httpSide net.Listener) {
	p := &portSplit{lis: lis, tls: tlsCfg, timeout: timeout, logger: logger, done: make(chan struct{}),
		sniffing: make(chan struct{}, MaxSniffing), perSource: DefaultMaxSniffingPerSource, sources: map[string]int{}}
	for _, o := range opts {
		o(p)
	}
	p.grpc, p.http = &sideListener{p: p, conns: make(chan net.Conn)}, &sideListener{p: p, conns: make(chan net.Conn)}
	go p.accept()
	return p.grpc, p.http
}

type portSplit struct {
	lis        net.Listener
	tls        *tls.Config
	timeout    time.Duration
	logger     *slog.Logger
	grpc, http *sideListener
	// sniffing bounds the connections being told apart, so that clients
	// that connect and send nothing hold a slot for timeout at most, and
	// no more than MaxSniffing of them at once; sources counts them by
	// source, each at most perSource.
	sniffing  chan struct{}
	perSource int
	mu        sync.Mutex
	sources   map[string]int
	done      chan struct{}
	closeOnce sync.Once
	err       error
}

func (p *portSplit) accept() {
	for {
		p.sniffing <- struct{}{}
		c, err := p.lis.Accept()
		if err != nil {
			p.close(err)
			return
		}
		src := httpserve.Source(c.RemoteAddr())
		if !p.admit(src) {
			<-p.sniffing
			_ = c.Close()
			continue
		}
		go func() {
			defer func() { p.release(src); <-p.sniffing }()
			p.route(c)
		}()
	}
}

// admit counts a connection of src being told apart, unless src has its
// share already.
func (p *portSplit) admit(src string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sources[src] >= p.perSource {
		return false
	}
	p.sources[src]++
	return true
}

func (p *portSplit) release(src string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sources[src]--; p.sources[src] <= 0 {
		delete(p.sources, src)
	}
}

func (p *portSplit) close(err error) {
	p.closeOnce.Do(func() {
		p.err = err
		close(p.done)
		_ = p.lis.Close()
	})
}

// http2Preface is what an HTTP/2 client sends first (RFC 9113, 3.4).
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

func (p *portSplit) route(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(p.timeout))
	br := bufio.NewReader(c)
	side, conn, err := p.tell(c, br)
	if err != nil {
		_ = c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	select {
	case side.conns <- conn:
	case <-p.done:
		_ = conn.Close()
	}
}

// tell reads what it needs of c's first bytes and returns the side c is
// for, with a conn that replays them.
func (p *portSplit) tell(c net.Conn, br *bufio.Reader) (*sideListener, net.Conn, error) {
	first, err := br.Peek(1)
	if err != nil {
		return nil, nil, err
	}
	if p.tls != nil && first[0] == 0x16 { // a TLS handshake record
		var rec bytes.Buffer
		protos, err := clientHelloProtocols(io.TeeReader(br, &rec))
		if err != nil {
			return nil, nil, err
		}
		conn := replay(c, append(rec.Bytes(), buffered(br)...))
		if slices.Contains(protos, "http/1.1") {
			return p.http, conn, nil // serveHTTPAPI's listener does the TLS
		}
		return p.grpc, conn, nil
	}
	for i := 1; i <= len(http2Preface); i++ {
		b, err := br.Peek(i)
		if err != nil {
			return nil, nil, err
		}
		if b[i-1] != http2Preface[i-1] {
			if p.tls != nil {
				// Plaintext on a TLS port: gRPC's handshake refuses it, as
				// before.
				return p.grpc, replay(c, buffered(br)), nil
			}
			return p.http, replay(c, buffered(br)), nil
		}
	}
	return p.grpc, replay(c, buffered(br)), nil
}

var errSniffed = errors.New("client hello read")

// clientHelloProtocols reads a TLS ClientHello from r and returns the ALPN
// protocols it offers. It runs crypto/tls's own parser on a connection that
// answers nothing, and stops it once the hello is parsed.
func clientHelloProtocols(r io.Reader) ([]string, error) {
	var protos []string
	var seen bool
	srv := tls.Server(&readOnlyConn{r: r}, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			protos, seen = h.SupportedProtos, true
			return nil, errSniffed
		},
	})
	err := srv.Handshake()
	if !seen {
		return nil, err
	}
	return protos, nil
}

// readOnlyConn reads from r and drops what is written (the alert the
// stopped handshake sends).
type readOnlyConn struct {
	net.Conn
	r io.Reader
}

func (c *readOnlyConn) Read(b []byte) (int, error)           { return c.r.Read(b) }
func (c *readOnlyConn) Write(b []byte) (int, error)          { return len(b), nil }
func (c *readOnlyConn) Close() error                         { return nil }
func (c *readOnlyConn) SetDeadline(time.Time) error          { return nil }
func (c *readOnlyConn) SetReadDeadline(time.Time) error      { return nil }
func (c *readOnlyConn) SetWriteDeadline(time.Time) error     { return nil }
func (c *readOnlyConn) LocalAddr() net.Addr                  { return &net.TCPAddr{} }
func (c *readOnlyConn) RemoteAddr() net.Addr                 { return &net.TCPAddr{} }
func (c *readOnlyConn) ConnectionState() tls.ConnectionState { return tls.ConnectionState{} }

// buffered returns a copy of what br has read ahead.
func buffered(br *bufio.Reader) []byte {
	b, _ := br.Peek(br.Buffered())
	return bytes.Clone(b)
}

// replayConn is a connection whose first bytes were read to tell it apart:
// reads replay them, then read the connection itself, with nothing in
// between for the rest of its life.
type replayConn struct {
	net.Conn
	head []byte
}

func replay(c net.Conn, head []byte) net.Conn { return &replayConn{Conn: c, head: head} }

func (c *replayConn) Read(b []byte) (int, error) {
	if len(c.head) == 0 {
		return c.Conn.Read(b)
	}
	n := copy(b, c.head)
	c.head = c.head[n:]
	return n, nil
}

// sideListener is one side of the port: Accept returns the connections
// routed to it.
type sideListener struct {
	p     *portSplit
	conns chan net.Conn
}

func (l *sideListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.p.done:
		return nil, net.ErrClosed
	}
}

func (l *sideListener) Close() error   { l.p.close(net.ErrClosed); return nil }
func (l *sideListener) Addr() net.Addr { return l.p.lis.Addr() }

// plainJSON makes a POST of JSON to /package.Service/Method a Connect
// unary call even without the Connect-Protocol-Version header, which
// vanguard otherwise takes for a REST call (and the API declares no REST
// routes): `curl -d '{...}' -H 'Content-Type: application/json'` is enough.
//
// A request for any other path is no API call: it is answered 404 and its
// connection closed, as grpc-go closed any HTTP/1.1 connection before, so
// that a scanner's requests do not hold connections for the idle timeout.
func plainJSON(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !apiPath(r.URL.Path) {
			w.Header().Set("Connection", "close")
			http.NotFound(w, r)
			return
		}
		if r.Method == http.MethodPost && r.Header.Get("Connect-Protocol-Version") == "" &&
			strings.HasPrefix(r.Header.Get("Content-Type"), "application/json") {
			r.Header.Set("Connect-Protocol-Version", "1")
		}
		next.ServeHTTP(w, r)
	})
}

// CORSOrigins parses --http-api-cors-origins: origins (scheme://host[:port],
// no path) or "*".
func CORSOrigins(list string) ([]string, error) {
	var out []string
	for o := range strings.SplitSeq(list, ",") {
		o = strings.TrimSpace(o)
		if o == "" {
			continue
		}
		if o != "*" {
			u, err := url.Parse(o)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
				return nil, fmt.Errorf("--http-api-cors-origins: %q is not an origin (scheme://host[:port]) or *", o)
			}
			o = u.Scheme + "://" + u.Host
		}
		out = append(out, o)
	}
	return out, nil
}

// The request headers a Connect or gRPC-Web client sends, and the
// response headers it reads, which a cross-origin page must be allowed.
const (
	corsAllowHeaders = "Content-Type, Authorization, Connect-Protocol-Version, Connect-Timeout-Ms, Connect-Accept-Encoding, " +
		"Connect-Content-Encoding, Grpc-Timeout, Grpc-Accept-Encoding, Grpc-Encoding, X-Grpc-Web, X-User-Agent"
	corsExposeHeaders = "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, Connect-Content-Encoding, Grpc-Encoding, Content-Encoding"
)

// withCORS answers the preflight of, and marks the answers to, pages of
// the allowed origins. No cookie is ever read, so credentials are not
// allowed: a page sends its bearer token in Authorization.
func withCORS(origins []string, next http.Handler) http.Handler {
	if len(origins) == 0 {
		return next
	}
	anyOrigin := slices.Contains(origins, "*")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		origin := r.Header.Get("Origin")
		if origin == "" || (!anyOrigin && !slices.Contains(origins, origin)) {
			next.ServeHTTP(w, r)
			return
		}
		h := w.Header()
		h.Set("Access-Control-Allow-Origin", origin)
		h.Add("Vary", "Origin")
		h.Set("Access-Control-Expose-Headers", corsExposeHeaders)
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			h.Set("Access-Control-Allow-Methods", "POST, GET")
			h.Set("Access-Control-Allow-Headers", corsAllowHeaders)
			h.Set("Access-Control-Max-Age", "7200")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// apiPath: /package.Service/Method, the only paths the API has.
func apiPath(p string) bool {
	svc, method, ok := strings.Cut(strings.TrimPrefix(p, "/"), "/")
	return ok && strings.HasPrefix(p, "/") && strings.Contains(svc, ".") && method != "" && !strings.Contains(method, "/")
}

// http1Only is tlsCfg for the HTTP API: http/1.1 is the only protocol it
// negotiates, on tlsCfg and on the config its GetConfigForClient answers
// with (server.TLSConfig answers that way, so that a rotated certificate is
// served, with h2 for gRPC: a clone's NextProtos alone was never read).
func http1Only(tlsCfg *tls.Config) *tls.Config {
	cfg := tlsCfg.Clone()
	cfg.NextProtos = []string{"http/1.1"}
	if get := cfg.GetConfigForClient; get != nil {
		cfg.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			c, err := get(hello)
			if c == nil || err != nil {
				return c, err
			}
			c = c.Clone()
			c.NextProtos = []string{"http/1.1"}
			return c, nil
		}
	}
	return cfg
}

// ServeAPI serves the HTTP API (Connect, gRPC-Web, HTTP/JSON) of g on
// lis under the HTTP listeners' bounds, each request held to maxRequest
// bytes (the server's, server.MaxRequestBytes), the body of a caller
// callers does not know left unread, until stop is called; over TLS
// with tlsCfg's certificates and client CA (negotiating http/1.1) when it
// is not nil, so that a client certificate is the same identity as on
// gRPC.
func ServeAPI(g *grpc.Server, callers Callers, maxRequest int, lis net.Listener, tlsCfg *tls.Config, origins []string, bounds httpserve.Bounds, logger *slog.Logger) (stop func(), err error) {
	h, err := transcoder(g, callers, maxRequest)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{
		Handler:           withCORS(origins, plainJSON(boundBody(maxRequest, h))),
		ReadHeaderTimeout: bounds.ReadHeaderTimeout,
		ReadTimeout:       bounds.ReadTimeout,
		// A Claim may wait up to 30 s for another holder (MaxWait).
		WriteTimeout:   max(bounds.WriteTimeout, time.Minute),
		IdleTimeout:    bounds.IdleTimeout,
		MaxHeaderBytes: bounds.MaxHeaderBytes,
		ErrorLog:       slog.NewLogLogger(logger.With("listener", "http-api").Handler(), slog.LevelDebug),
	}
	// HTTP/1.1 only, even if a TLS config offered h2: net/http's HTTP/2
	// server would hold 250 streams per connection with none of the gRPC
	// side's bounds (--max-pending-calls, --max-concurrent-streams).
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	capped := httpserve.CapConnections(lis, bounds)
	srv.ConnState = capped.ConnState
	lis = capped
	if tlsCfg != nil {
		lis = tls.NewListener(lis, http1Only(tlsCfg)) // *tls.Conn, so that http.Server sets Request.TLS
	}
	go func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			logger.Error("listener failed", "listener", "http-api", "error", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}
