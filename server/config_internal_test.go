package server

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

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
