package admission

import (
	"net"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/require"
)

// pipeListener hands out the server ends of in-memory connections, so
// that synctest can tell when Accept is blocked.
type pipeListener struct {
	conns  chan net.Conn
	closed chan struct{}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}
func (l *pipeListener) Close() error   { close(l.closed); return nil }
func (l *pipeListener) Addr() net.Addr { return &net.TCPAddr{} }

// TestLimitListener: with n connections open, the next is not accepted
// until one of them closes; closing a connection twice frees one slot; a
// closed listener ends a waiting Accept.
func TestLimitListener(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		inner := &pipeListener{conns: make(chan net.Conn, 8), closed: make(chan struct{})}
		for range 4 {
			server, client := net.Pipe()
			t.Cleanup(func() { _ = client.Close() })
			inner.conns <- server
		}
		l := limitConnections(inner, 2)
		a, err := l.Accept()
		require.NoError(t, err)
		b, err := l.Accept()
		require.NoError(t, err)

		accepted := make(chan net.Conn, 2)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					close(accepted)
					return
				}
				accepted <- c
			}
		}()
		synctest.Wait()
		require.Empty(t, accepted, "a third connection is held back while two are open")

		require.NoError(t, a.Close())
		_ = a.Close()
		synctest.Wait()
		require.Len(t, accepted, 1, "closing one (twice) lets exactly one more in")

		require.NoError(t, b.Close())
		synctest.Wait()
		require.Len(t, accepted, 2)

		require.NoError(t, l.Close())
		synctest.Wait()
		for c := range accepted {
			_ = c.Close()
		}
	})
}
