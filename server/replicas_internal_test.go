package server

import (
	"net"
	"os"
	"testing"
	"time"

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

func TestReplicaValidate(t *testing.T) {
	for _, tc := range []struct {
		name  string
		r     Replica
		field string
	}{
		{"defaults", Replica{}, ""},
		{"negative heartbeat", Replica{HeartbeatInterval: -time.Second}, "Replica.HeartbeatInterval"},
		{"live for not above the heartbeat", Replica{HeartbeatInterval: 2 * time.Second, MemberLiveFor: 2 * time.Second}, "Replica.MemberLiveFor"},
		{"live for below the default heartbeat", Replica{MemberLiveFor: time.Second / 2}, "Replica.MemberLiveFor"},
		{"address without port", Replica{AdvertiseAddress: "10.0.0.1"}, "Replica.AdvertiseAddress"},
		{"good", Replica{AdvertiseAddress: "10.0.0.1:7350", HeartbeatInterval: time.Second, MemberLiveFor: 5 * time.Second}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var fields []string
			tc.r.validate(func(field string, _ any, _ string) { fields = append(fields, field) })
			if tc.field == "" {
				require.Empty(t, fields)
				return
			}
			require.Equal(t, []string{tc.field}, fields)
		})
	}
}
