package replicas

import (
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestAdvertiseAddress(t *testing.T) {
	host, err := os.Hostname()
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		addr net.Addr
		want string
	}{
		{"loopback", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 7350}, "127.0.0.1:7350"},
		{"pod IP", &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 7350}, "10.1.2.3:7350"},
		{"IPv4 unspecified", &net.TCPAddr{IP: net.IPv4zero, Port: 7350}, net.JoinHostPort(host, "7350")},
		{"IPv6 unspecified", &net.TCPAddr{IP: net.IPv6unspecified, Port: 7350}, net.JoinHostPort(host, "7350")},
		{"no IP", &net.TCPAddr{Port: 7350}, net.JoinHostPort(host, "7350")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, advertiseAddress(tc.addr))
		})
	}
}
