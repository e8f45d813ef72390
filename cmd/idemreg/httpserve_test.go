package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/server/access"
)

// TestServeHTTPBounds: serve's HTTP listeners hold
// at most --http-max-connections each, a new one taking the place of one
// that sends nothing (httpserve's TestConnectionCaps: closed at once when
// every one is busy); a slot comes back when a connection closes; a form whose body is sent a
// byte at a time is cut at --http-read-timeout. On main 5,000 idle
// connections were all held, and the slow body kept its connection until
// it was complete.
func TestServeHTTPBounds(t *testing.T) {
	const token = "http-bounds-oncall-token"
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte("identities:\n  - name: oncall\n    token_hashes: [\""+access.HashToken(token)+"\"]\n    consumers: [\"billing.*\"]\n    admin: [\"billing.*\"]\n"), 0o600))
	listen, consoleAddr, metricsAddr := servetest.FreeAddr(t), servetest.FreeAddr(t), servetest.FreeAddr(t)
	const maxConns = 4
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--listen", listen, "--data-dir", filepath.Join(dir, "data"), "--config", cfgFile,
			"--sweep-interval", "0", "--console-listen", consoleAddr, "--metrics-listen", metricsAddr,
			"--http-max-connections", fmt.Sprint(maxConns), "--http-read-timeout", "1s"}, io.Discard, io.Discard)
	}()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	// One connection per request, closed after it.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	scrape := func() error {
		res, err := client.Get("http://" + metricsAddr + "/metrics")
		if err != nil {
			return err
		}
		defer res.Body.Close()
		_, err = io.Copy(io.Discard, res.Body)
		if err == nil && res.StatusCode != http.StatusOK {
			err = errors.New(res.Status)
		}
		return err
	}
	require.Eventually(t, func() bool { return scrape() == nil }, 10*time.Second, 20*time.Millisecond)

	t.Run("connections", func(t *testing.T) {
		idle := make([]net.Conn, maxConns)
		for i := range idle {
			c, err := net.Dial("tcp", metricsAddr)
			require.NoError(t, err)
			defer c.Close()
			idle[i] = c
		}
		// The listener accepts in order: the idle ones hold every slot
		// (each is accepted before the next connection is). A new one
		// takes the place of the one silent longest rather than being
		// refused: on main, idle connections shut every caller out.
		extra, err := net.Dial("tcp", metricsAddr)
		require.NoError(t, err)
		defer extra.Close()
		_, _ = io.WriteString(extra, "GET /metrics HTTP/1.1\r\nHost: metrics\r\n\r\n")
		require.NoError(t, extra.SetReadDeadline(time.Now().Add(30*time.Second))) // a guard against a hang
		n, err := extra.Read(make([]byte, 1))
		require.Equal(t, 1, n, "a connection at the cap is served: %v", err)
		require.NoError(t, idle[0].SetReadDeadline(time.Now().Add(30*time.Second)))
		n, err = idle[0].Read(make([]byte, 1))
		require.Zero(t, n, "the connection silent longest made room")
		require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "it was closed at once, not held: %v", err)
		_ = extra.Close()

		require.NoError(t, idle[0].Close())
		require.Eventually(t, func() bool { return scrape() == nil }, 10*time.Second, 20*time.Millisecond,
			"a connection that closes gives its slot back")
	})

	t.Run("slow body", func(t *testing.T) {
		const size = 100
		// The console listens a moment after the metrics do.
		var c net.Conn
		require.Eventually(t, func() bool {
			var err error
			c, err = net.Dial("tcp", consoleAddr)
			return err == nil
		}, 10*time.Second, 20*time.Millisecond)
		defer c.Close()
		_, err := fmt.Fprintf(c, "POST /signin HTTP/1.1\r\nHost: %s\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n", consoleAddr, size)
		require.NoError(t, err)
		sent := make(chan int, 1)
		go func() {
			n := 0
			for ; n < size; n++ { // 10 s for the whole body
				if _, err := io.WriteString(c, "x"); err != nil {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			sent <- n
		}()
		require.NoError(t, c.SetReadDeadline(time.Now().Add(60*time.Second))) // a guard against a hang
		answer, err := io.ReadAll(c)
		require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the server closed the connection")
		_ = c.Close()
		require.Less(t, <-sent, size, "the connection was closed before the body was complete; the server answered %q", firstLine(answer))
	})
}

func firstLine(b []byte) string {
	line, _, _ := strings.Cut(string(b), "\r\n")
	return line
}
