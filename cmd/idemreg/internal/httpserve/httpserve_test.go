package httpserve_test

import (
	"bufio"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
)

// conn is a client connection from source address ip (all of
// 127.0.0.0/8 is loopback), to tell sources apart on one machine.
func conn(t *testing.T, ip string, addr net.Addr) net.Conn {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	c, err := d.Dial("tcp", addr.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// get sends a GET on c (kept alive) and returns its answer's status, or
// the error that ended the connection.
func get(c net.Conn, path string) (int, error) {
	if _, err := io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		return 0, err
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second)) // a guard against a hang
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, err
	}
	_, err = io.Copy(io.Discard, res.Body)
	_ = res.Body.Close()
	return res.StatusCode, err
}

// closedAtOnce reports whether the server closed c without a word (and
// not after the guard's deadline).
func closedAtOnce(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(30*time.Second))) // a guard against a hang
	n, err := c.Read(make([]byte, 1))
	require.Zero(t, n)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "closed at once, not held: %v", err)
}

// TestConnectionCaps: a source holds at most MaxConnectionsPerSource; at a
// cap, a new connection takes the place of one without a request in
// progress (the source's own at its cap, the idle one of the biggest
// source at the listener's), and is closed at once only when every
// connection concerned has a request in progress.
func TestConnectionCaps(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 16)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/block" {
			started <- struct{}{}
			<-release
		}
		w.WriteHeader(http.StatusNoContent)
	})
	b := httpserve.DefaultBounds()
	b.MaxConnections, b.MaxConnectionsPerSource = 4, 2
	stop, addr, err := httpserve.Serve("test", "127.0.0.1:0", h, b, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(stop)
	t.Cleanup(func() { close(release) })

	// block starts a request that holds its connection until release, or
	// reports that the connection was closed first.
	tryBlock := func(ip string) bool {
		c := conn(t, ip, addr)
		_, err := io.WriteString(c, "GET /block HTTP/1.1\r\nHost: test\r\n\r\n")
		require.NoError(t, err)
		closed := make(chan struct{})
		go func() { _, _ = c.Read(make([]byte, 1)); close(closed) }()
		select {
		case <-started:
			return true
		case <-closed:
			return false
		}
	}
	// A connection turns idle a moment after its client read the
	// answer: what waits for it retries.
	const waitFor, tick = 10 * time.Second, 10 * time.Millisecond

	require.True(t, tryBlock("127.0.0.2"))
	require.True(t, tryBlock("127.0.0.2"))
	closedAtOnce(t, conn(t, "127.0.0.2", addr)) // its share, every one busy

	idle := conn(t, "127.0.0.3", addr)
	code, err := get(idle, "/")
	require.NoError(t, err)
	require.Equal(t, http.StatusNoContent, code)
	require.True(t, tryBlock("127.0.0.3"))
	// The listener is full (4); the new source takes the idle one's place.
	var c net.Conn
	require.Eventually(t, func() bool {
		c = conn(t, "127.0.0.4", addr)
		code, err := get(c, "/")
		return err == nil && code == http.StatusNoContent
	}, waitFor, tick, "a new source is served at the listener's cap")
	closedAtOnce(t, idle)

	// Every connection of the full listener is busy but c, which is idle:
	// 127.0.0.5 takes its place; then none is idle.
	require.Eventually(t, func() bool { return tryBlock("127.0.0.5") }, waitFor, tick)
	closedAtOnce(t, c)
	closedAtOnce(t, conn(t, "127.0.0.6", addr))
}
