package server

import (
	"cmp"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/idemreg/idemreg/server/internal/membership"
	"github.com/idemreg/idemreg/storage"
)

// Replicas sharing a store find each other through it: each heartbeats a
// row with its ID and the address its peers reach it on
// (server/internal/membership), when the store keeps a membership
// (storage.Membership; both backends do, the embedded one trivially).
// docs/operations.md, "Replicas", says how to set the address up.

// Defaults of Replica.
const (
	DefaultHeartbeat = membership.DefaultInterval
	DefaultLiveFor   = membership.DefaultLiveFor
)

// Replica is this replica's place in the membership.
type Replica struct {
	// ID names this replica in the membership; empty: a new one for each
	// run of the process (the host name and random bytes).
	ID string
	// AdvertiseAddress is host:port, where the other replicas reach this
	// one's gRPC listener. Empty: the listener's address, unless its host
	// is unspecified (0.0.0.0, ::), when the host name replaces it. In
	// Kubernetes, give the pod's IP (the downward API's status.podIP) and
	// the port.
	AdvertiseAddress string
	// HeartbeatInterval is how often the replica writes its heartbeat and reads
	// its peers (DefaultHeartbeat); MemberLiveFor is how old a heartbeat may be,
	// by the store's clock, for its replica to count as live
	// (DefaultLiveFor), more than HeartbeatInterval.
	HeartbeatInterval, MemberLiveFor time.Duration
}

func (r Replica) validate(bad func(field string, value any, problem string)) {
	if r.HeartbeatInterval < 0 {
		bad("Replica.HeartbeatInterval", r.HeartbeatInterval, "must not be negative")
	}
	if r.MemberLiveFor < 0 {
		bad("Replica.MemberLiveFor", r.MemberLiveFor, "must not be negative")
	}
	beat, live := cmp.Or(r.HeartbeatInterval, DefaultHeartbeat), cmp.Or(r.MemberLiveFor, DefaultLiveFor)
	if r.HeartbeatInterval >= 0 && r.MemberLiveFor >= 0 && live <= beat {
		bad("Replica.MemberLiveFor", live, fmt.Sprintf("must be more than the heartbeat interval (%v)", beat))
	}
	if a := r.AdvertiseAddress; a != "" {
		if _, _, err := net.SplitHostPort(a); err != nil {
			bad("Replica.AdvertiseAddress", a, "must be host:port")
		}
	}
}

// advertiseAddress is where peers reach a replica listening on lis when
// it advertises nothing itself: the listener's address, or the host name
// with its port when the listener's host is unspecified.
func advertiseAddress(lis net.Addr) string {
	tcp, ok := lis.(*net.TCPAddr)
	if !ok {
		return lis.String()
	}
	if tcp.IP != nil && !tcp.IP.IsUnspecified() {
		return tcp.String()
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	return net.JoinHostPort(host, fmt.Sprint(tcp.Port))
}

// newMembers is the membership of the replica serving on lis, nil when
// the store keeps none.
func (s *Server) newMembers(lis net.Addr) *membership.Members {
	ms, ok := s.store.(storage.Membership)
	if !ok {
		return nil
	}
	r := s.cfg.Replica
	return membership.New(ms, membership.Config{
		ID: r.ID, Address: cmp.Or(r.AdvertiseAddress, advertiseAddress(lis)),
		Interval: r.HeartbeatInterval, LiveFor: r.MemberLiveFor, Logger: s.cfg.Logger,
	})
}

// Members returns the replicas sharing the store as this one last read
// them (this one among them once it has heartbeat), nil before Serve or
// when the store keeps no membership.
func (s *Server) Members() []storage.Member {
	if m := s.members.Load(); m != nil {
		return m.Live()
	}
	return nil
}
