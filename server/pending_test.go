package server_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// servePair serves srv on a gRPC listener and a health listener on
// loopback until the test ends, and returns their addresses.
func servePair(t *testing.T, srv *server.Server) (grpcAddr, healthAddr string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	healthDone := make(chan error, 1)
	go func() { healthDone <- srv.ServeHealth(hlis) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, <-healthDone)
	})
	return lis.Addr().String(), hlis.Addr().String()
}

// check is a probe's health Check on addr, from a well-behaved client.
func check(t *testing.T, addr string) error {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: server.LivenessService})
	return err
}

// hold opens calls on p whose request never comes, and returns how many
// the server holds and how many it answered at once with a status.
func hold(t *testing.T, p *rawPeer, calls int) (held, refused int) {
	t.Helper()
	for range calls {
		_, err := p.open("/grpc.health.v1.Health/Check", 0, false)
		require.NoError(t, err)
	}
	answered, err := p.resetsBefore()
	require.NoError(t, err)
	for _, reset := range answered {
		require.False(t, reset, "held calls are answered with a status, not reset")
	}
	return calls - len(answered), len(answered)
}

// TestHeldCallsBounded (issue 25, finding 1): peers that open calls and
// never send their request message are held to MaxPendingCalls over both
// listeners, half on each, however many connections and streams they
// open; the calls beyond are answered at once with RESOURCE_EXHAUSTED,
// TOO_MANY_STREAMS. A flood of one listener leaves the other its share
// (the probes' health port keeps answering while the gRPC port is
// flooded), and a flooding connection that closes gives its slots back.
// On main every one of the 2 × 17 × 64 calls was held.
//
// The flood comes from several sources (127.0.0.2, ...), none of them at
// the health listener's MaxHealthConnectionsPerSource, and the checks from
// another (127.0.0.1): one source alone has its 17th connection closed at
// once by that share, before it could call, and this test is about what
// the calls of many connections hold, not about one source's share
// (cmd/idemreg's TestHealthProbeUnderFlood).
func TestHeldCallsBounded(t *testing.T) {
	bounds := server.DefaultBounds()
	srv, err := server.New(memStore(t), server.Config{HealthInterval: time.Hour, Bounds: bounds})
	require.NoError(t, err)
	grpcAddr, healthAddr := servePair(t, srv)
	share := server.DefaultMaxPendingCalls / 2
	streams := int(bounds.MaxConcurrentStreams)
	conns := share/streams + 1 // one connection more than the share needs
	sources := conns/bounds.MaxHealthConnectionsPerSource + 1

	flood := func(addr string) (peers []*rawPeer, held, refused int) {
		for i := range conns {
			p := dialRawFrom(t, addr, "127.0.0."+strconv.Itoa(2+i%sources))
			peers = append(peers, p)
			h, r := hold(t, p, streams)
			held, refused = held+h, refused+r
		}
		return peers, held, refused
	}
	grpcPeers, held, refused := flood(grpcAddr)
	require.Equal(t, share, held, "the gRPC listener holds its share of pending calls")
	require.Equal(t, conns*streams-share, refused)
	require.NoError(t, check(t, healthAddr), "a flood of the gRPC port leaves the health port its share")
	requireStatus(t, check(t, grpcAddr), codes.ResourceExhausted, idemregv1.ReasonTooManyStreams)

	// The health listener: each connection carries at most
	// HealthMaxConcurrentStreams calls, so that no set of its connections
	// (at most MaxConnections) holds its share, and the probe is
	// answered. With 64 a connection, as on --listen, one source's
	// MaxHealthConnectionsPerSource connections held all 1,024 and the
	// probe was refused TOO_MANY_STREAMS.
	// All but one of its connection slots: those, not calls, are what
	// keeps a probe out now (a source holds MaxHealthConnectionsPerSource).
	healthConns := int(bounds.MaxConnections) - 1
	require.Less(t, healthConns*server.HealthMaxConcurrentStreams, share)
	var healthHeld int
	for i := range healthConns {
		p := dialRawFrom(t, healthAddr, "127.0.0."+strconv.Itoa(2+i/bounds.MaxHealthConnectionsPerSource))
		h, r := hold(t, p, server.HealthMaxConcurrentStreams)
		healthHeld += h
		require.Zero(t, r)
	}
	require.Equal(t, healthConns*server.HealthMaxConcurrentStreams, healthHeld, "the health listener holds what its connections carry")
	require.NoError(t, check(t, healthAddr), "the probe is answered while every health connection holds its calls")

	require.NoError(t, grpcPeers[0].conn.Close())
	require.Eventually(t, func() bool { return check(t, grpcAddr) == nil }, 10*time.Second, 10*time.Millisecond,
		"a flooding connection that closes gives its slots back")
}

// TestPendingCallSlotsReturn: a call gives its slot back as soon as its
// request has arrived, so that long-lived streams (health Watch) and
// finished calls do not count; only calls still waiting for their
// request do.
func TestPendingCallSlotsReturn(t *testing.T) {
	srv, err := server.New(memStore(t), server.Config{HealthInterval: time.Hour, Bounds: server.Bounds{MaxPendingCalls: 8}})
	require.NoError(t, err)
	grpcAddr, _ := servePair(t, srv)
	for range 20 { // more calls than slots, one after another
		require.NoError(t, check(t, grpcAddr))
	}
	p := dialRaw(t, grpcAddr)
	for range 6 { // Watch streams with their request sent, held open
		id, err := p.open(watchMethod, 0, true)
		require.NoError(t, err)
		// One at a time: a call counts from its headers until its
		// handler has read the message, which the server's reader may
		// have taken in long before.
		answers, _ := p.await([]uint32{id})
		require.Equal(t, answerServed, answers[id])
	}
	held, refused := hold(t, p, 6)
	require.Equal(t, 4, held, "the listener's half of 8, with 6 Watch streams open")
	require.Equal(t, 2, refused)
}

// TestHealthProbeUnderHeldCalls (issue 35, weakness 5): one source's
// MaxHealthConnectionsPerSource connections to the health listener, each
// opening the main listener's MaxConcurrentStreams calls whose request
// never comes, hold HealthMaxConcurrentStreams calls a connection, and the
// kubelet's probe from another address is answered. Before, they held the
// listener's whole share of pending calls (16 × 64 = 1,024), and the probe
// was refused TOO_MANY_STREAMS until they closed.
func TestHealthProbeUnderHeldCalls(t *testing.T) {
	bounds := server.DefaultBounds()
	srv, err := server.New(memStore(t), server.Config{HealthInterval: time.Hour, Bounds: bounds})
	require.NoError(t, err)
	_, healthAddr := servePair(t, srv)
	calls := int(bounds.MaxConcurrentStreams)
	held := 0
	for range bounds.MaxHealthConnectionsPerSource {
		p := dialRawFrom(t, healthAddr, "127.0.0.2")
		for range calls {
			_, err := p.open("/grpc.health.v1.Health/Check", 0, false)
			require.NoError(t, err)
		}
		answered, err := p.resetsBefore()
		require.NoError(t, err)
		held += calls - len(answered)
	}
	require.Equal(t, bounds.MaxHealthConnectionsPerSource*server.HealthMaxConcurrentStreams, held)
	require.NoError(t, check(t, healthAddr), "the probe is answered")
}
