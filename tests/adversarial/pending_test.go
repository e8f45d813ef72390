package adversarial

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The HTTP listeners (metrics here; the console and pprof use the same
// server settings, cmd/idemreg serveHTTP) as main bounds them.
const (
	httpMaxHeaderBytes    = 64 << 10
	httpReadHeaderTimeout = 5 * time.Second
)

// httpListenerCaps (finding 7, partly pending): attacks on serve's HTTP
// listeners. What main already bounds, checked on --metrics-listen: a
// request whose headers are over 64 KiB (MaxHeaderBytes, plus net/http's
// 4 KiB of slack) is answered 431 and never reaches a handler; a request
// whose headers drip in is cut when its headers have not all come within
// 5 s (ReadHeaderTimeout). Pending (finding 7): a cap on the connections
// each HTTP listener holds, as --max-connections caps the gRPC ones;
// expected bound: no more than the cap the fix documents are open at
// once, the rest wait, and the metrics scrape is still answered.
func httpListenerCaps(t *testing.T, s *suite) {
	// Header bomb.
	c, err := net.DialTimeout("tcp", s.metricsAddr, 10*time.Second)
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(closeGuard))
	_, err = fmt.Fprintf(c, "GET /metrics HTTP/1.1\r\nHost: idemreg\r\nX-Pad: %s\r\n\r\n", randomText(2*httpMaxHeaderBytes))
	if err == nil { // the server may close before it read everything
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, resp.StatusCode)
	}

	// Slowloris: a header line every second, never the end of the headers.
	d, err := net.DialTimeout("tcp", s.metricsAddr, 10*time.Second)
	require.NoError(t, err)
	defer d.Close()
	go func() {
		if _, err := fmt.Fprint(d, "GET /metrics HTTP/1.1\r\nHost: idemreg\r\n"); err != nil {
			return
		}
		for i := range 30 {
			if _, err := fmt.Fprintf(d, "X-Drip-%d: 1\r\n", i); err != nil {
				return
			}
			time.Sleep(time.Second)
		}
	}()
	start := time.Now()
	_ = d.SetReadDeadline(time.Now().Add(httpReadHeaderTimeout + closeGuard))
	reply, _ := bufio.NewReader(d).ReadString('\n') // a 408, or nothing, then EOF
	took := time.Since(start)
	require.Less(t, took, httpReadHeaderTimeout+closeGuard, "the dripping request was not cut")
	t.Logf("a request dripping a header a second was cut after %v (%q)", took.Round(time.Millisecond), strings.TrimSpace(reply))
	require.Positive(t, s.metric(t, "idemreg_connections", `listener="grpc"`), "metrics still scraped")

	// Finding 7: each HTTP listener takes at most --http-max-connections
	// connections, and one source at most --http-max-connections-per-source
	// (issue 35): at a cap a new one takes the place of an idle one, or is
	// closed before it is served if none is idle; a freed slot serves
	// again.
	t.Run("connections per HTTP listener", func(t *testing.T) {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				_ = c.Close()
			}
		}()
		// The suite's scraper may keep a connection of its own open: open
		// more than the cap, each with a request, and count what is served.
		served, closed := 0, 0
		for range httpMaxConnections + 4 {
			c, err := net.Dial("tcp", s.metricsAddr)
			require.NoError(t, err)
			held = append(held, c)
			_, _ = c.Write([]byte("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
		}
		for _, c := range held {
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			line, err := bufio.NewReader(c).ReadString('\n')
			if err == nil && strings.Contains(line, "200") {
				served++
			} else {
				closed++
			}
		}
		open := stillOpen(held, time.Second)
		require.LessOrEqual(t, open, httpMaxConnectionsPerSource, "no more than the source's share is open at once")
		require.Equal(t, httpMaxConnections+4, served+closed, "each is served or closed, none held waiting")
		for _, c := range held {
			_ = c.Close()
		}
		held = nil

		require.Eventually(t, func() bool {
			c, err := net.Dial("tcp", s.metricsAddr)
			if err != nil {
				return false
			}
			defer c.Close()
			_, _ = c.Write([]byte("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			line, _ := bufio.NewReader(c).ReadString('\n')
			return strings.Contains(line, "200")
		}, 10*time.Second, 100*time.Millisecond, "a freed slot serves again")
		t.Logf("metrics listener (cap %d, %d a source): of %d connections of one source %d served, %d closed unserved, %d left open", httpMaxConnections, httpMaxConnectionsPerSource, httpMaxConnections+4, served, closed, open)
	})
}

// claimKeyRotation (finding 6). Rotating the
// store's claim key, the one claim secrets and page tokens are derived
// from. Expected bound after the fix: a secret issued under the old key
// still completes its claim (the old key is kept for verification until
// the claims it signed have ended), a secret or page token forged under
// a retired key is FAILED_PRECONDITION / INVALID_ARGUMENT, and no
// acknowledged Complete of the neighbour is lost across the rotation.
func claimKeyRotation(t *testing.T, s *suite) {
	// The rotation needs a shared store and a second replica to show its
	// bound; server.TestClaimKeyRotationAcrossReplicas (two replicas on
	// one PostgreSQL database) and TestClaimKeyRotationEmbedded hold it.
	// This suite runs one replica on the embedded store, whose rotation
	// needs serve stopped (docs/operations.md).
	t.Skip("finding 6: held by server.TestClaimKeyRotationAcrossReplicas; needs a second replica on a shared store")
}

// consoleSignIn (finding 8). Guessing console
// sign-in tokens on --console-listen. Expected bound after the fix: a
// wrong token is refused without saying which part was wrong, repeated
// failures from one peer are slowed or refused at the rate the fix
// documents, and a signed-in operator and the gRPC tenants are served
// meanwhile.
func consoleSignIn(t *testing.T, s *suite) {
	// The suite's serve has no console listener; the fix (sign-in only for
	// identities that administer something, at most 8 sessions per
	// identity) is held by console.TestConsoleSignInNeedsAdminGrant and
	// TestConsoleSessionFlood against the console's real listener.
	t.Skip("finding 8: held by the console's (cmd/idemreg/internal/console) TestConsoleSignInNeedsAdminGrant and TestConsoleSessionFlood")
}
