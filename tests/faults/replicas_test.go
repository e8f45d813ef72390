//go:build linearizability || chaos

package faults

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"

	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/tests/lincheck"
)

// TestLinearizabilityReplicasSIGKILL runs the workload across three
// `idemreg serve` replicas on one PostgreSQL database, each call going to
// the next replica (round robin), so that a waiting Claim and the
// Complete that ends its wait usually meet on different replicas; the
// replicas re-check only every 10s, so a waiter learns of a Complete
// through another replica by being told (server/internal/peers). The
// first replica is SIGKILLed and restarted again and again while its
// peers' Claims wait and its own are marked on records: the history
// must stay linearizable, and the serving replicas must keep answering.
func TestLinearizabilityReplicasSIGKILL(t *testing.T) {
	db := pgtest.NewDatabase(t)
	env := []string{"IDEMREG_DATABASE_URL=" + db}
	args := []string{"--wait-recheck", "10s", "--heartbeat-interval", "200ms", "--member-live-for", "1s"}
	bin := servetest.Binary(t)
	// Each replica's own connection serves its health checks and probes;
	// the workload's spreads the calls over all of them.
	replica := func() *harness {
		r := &harness{t: t, bin: bin, dir: t.TempDir(), addr: servetest.FreeAddr(t), env: env, args: args}
		r.conn = dialFast(t, "passthrough:///"+r.addr)
		r.start()
		return r
	}
	h := replica()
	peers := []*harness{replica(), replica()}
	addrs := []resolver.Address{{Addr: h.addr}}
	for _, p := range peers {
		addrs = append(addrs, resolver.Address{Addr: p.addr})
	}
	r := manual.NewBuilderWithScheme("replicas")
	r.InitialState(resolver.State{Addresses: addrs})
	conn := dialFast(t, r.Scheme()+":///idemreg", grpc.WithResolvers(r),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`))
	h.rec = lincheck.NewRecorder()
	// Waiting Claims are a third of the Claims, so that many waits end
	// through another replica.
	h.work = lincheck.NewWorkload(conn, h.rec, lincheck.Config{Clients: *linClients, Keys: *linKeys, Seed: uint64(time.Now().UnixNano()), Wait: 30})
	h.run()

	const kills = 4
	for i := range kills {
		time.Sleep(phases(kills + 1))
		h.kill()
		began := time.Now()
		h.start()
		h.recovered(fmt.Sprintf("SIGKILL %d of the first replica", i+1), began)
	}
	time.Sleep(phases(kills + 1))
	h.finish()
	for _, p := range peers {
		p.mu.Lock()
		for _, line := range p.problems {
			t.Errorf("idemreg serve (peer): %s", line)
		}
		p.mu.Unlock()
	}
}

// dialFast connects to target, reconnecting fast after a restart (the default
// backoff grows to 2 min).
func dialFast(t *testing.T, target string, opts ...grpc.DialOption) *grpc.ClientConn {
	conn, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 300 * time.Millisecond},
			MinConnectTimeout: time.Second,
		})}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
