package server_test

import (
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// Waits across replicas told by the replica that ends the attempt
// (server/internal/replicas). Every replica here re-checks only every
// slowRecheck, longer than the waits (crossWait), and the holder's lease
// (10s) outlasts them too: a waiter that answers anything but
// OUTCOME_IN_PROGRESS was woken by being told.
const (
	slowRecheck = 30 * time.Second
	crossWait   = 8 * time.Second
)

// peerReplica is one in-process server on a shared database.
type peerReplica struct {
	srv  *server.Server
	addr string
	c    idemregv1.RegistryServiceClient
	stop func() // ends Serve gracefully: the replica leaves the membership
}

func replicaConfig(recheck time.Duration) server.Config {
	return server.Config{WaitRecheck: recheck, Replica: server.Replica{HeartbeatInterval: 20 * time.Millisecond, MemberLiveFor: 2 * time.Second}}
}

// startPeer serves a store of its own on db with cfg.
func startPeer(t *testing.T, db string, cfg server.Config) *peerReplica {
	t.Helper()
	srv, err := server.New(openPostgres(t, db), cfg)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	r := &peerReplica{srv: srv, addr: lis.Addr().String()}
	stopped := false
	r.stop = func() {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(t, <-done)
		}
	}
	t.Cleanup(r.stop)
	r.c = idemregv1.NewRegistryServiceClient(servertest.Dial(t, r.addr))
	return r
}

// seeEachOther waits until every peerReplica of rs counts exactly the
// replicas of rs as live members, with their addresses.
func seeEachOther(t *testing.T, rs ...*peerReplica) {
	t.Helper()
	var want []string
	for _, r := range rs {
		want = append(want, r.addr)
	}
	slices.Sort(want)
	require.Eventually(t, func() bool {
		for _, r := range rs {
			var got []string
			for _, m := range r.srv.Members() {
				got = append(got, m.Address)
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond)
}

func (r *peerReplica) waitersReach(t *testing.T, n int) {
	t.Helper()
	waitHarness{srv: r.srv}.waitersReach(t, n)
}

// TestWaitWokenAcrossReplicas: with two and with three replicas, Claims
// waiting on the others wake when the attempt ends through the first:
// completed (they replay the result), released (one takes over), parked,
// and completed in a batch.
func TestWaitWokenAcrossReplicas(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(map[int]string{2: "two", 3: "three"}[n], func(t *testing.T) {
			db := pgtest.NewDatabase(t)
			rs := make([]*peerReplica, n)
			for i := range rs {
				rs[i] = startPeer(t, db, replicaConfig(slowRecheck))
			}
			seeEachOther(t, rs...)
			a, others := rs[0], rs[1:]
			// waitOn starts a waiter on each other peerReplica for key.
			waitOn := func(key string) []<-chan claimAnswer {
				var got []<-chan claimAnswer
				for _, r := range others {
					got = append(got, claimAsync(t.Context(), r.c, waiting(key, crossWait)))
					r.waitersReach(t, 1)
				}
				return got
			}

			t.Run("Complete", func(t *testing.T) {
				holder, err := a.c.Claim(t.Context(), claimReq("complete", "fp"))
				require.NoError(t, err)
				got := waitOn("complete")
				completeWith(t, a.c, holder, "complete", "through A")
				for _, g := range got {
					ans := <-g
					require.NoError(t, ans.err)
					require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
					require.Equal(t, "through A", string(ans.res.GetRecord().GetResult().GetResponse().GetData()))
				}
			})
			t.Run("Release", func(t *testing.T) {
				holder, err := a.c.Claim(t.Context(), claimReq("release", "fp"))
				require.NoError(t, err)
				got := waitOn("release")
				_, err = a.c.Release(t.Context(), &idemregv1.ReleaseRequest{Consumer: holder.GetRecord().GetConsumer(), Kind: idemregv1.Kind_KIND_OPERATION,
					Key: "release", Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret()})
				require.NoError(t, err)
				var outcomes []idemregv1.Outcome
				for _, g := range got {
					ans := <-g
					require.NoError(t, ans.err)
					outcomes = append(outcomes, ans.res.GetOutcome())
				}
				// One takes over at once; another, if any, finds it
				// in progress under the new holder and waits on, to
				// the end of its wait: nothing ends that attempt.
				require.Contains(t, outcomes, idemregv1.Outcome_OUTCOME_ACQUIRED)
			})
			t.Run("Park", func(t *testing.T) {
				holder, err := a.c.Claim(t.Context(), claimReq("park", "fp"))
				require.NoError(t, err)
				got := waitOn("park")
				_, err = a.c.Park(t.Context(), &idemregv1.ParkRequest{Consumer: holder.GetRecord().GetConsumer(), Kind: idemregv1.Kind_KIND_OPERATION,
					Key: "park", Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret(), Reason: "outcome unknown"})
				require.NoError(t, err)
				for _, g := range got {
					ans := <-g
					require.NoError(t, ans.err)
					require.Equal(t, idemregv1.Outcome_OUTCOME_PARKED, ans.res.GetOutcome())
				}
			})
			t.Run("BatchComplete", func(t *testing.T) {
				holder, err := a.c.Claim(t.Context(), claimReq("batch", "fp"))
				require.NoError(t, err)
				got := waitOn("batch")
				r := claimReq("batch", "")
				res, err := a.c.BatchComplete(t.Context(), &idemregv1.BatchCompleteRequest{Requests: []*idemregv1.CompleteRequest{{
					Consumer: r.Consumer, Kind: r.Kind, Key: "batch", Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret(), Result: response("batched"),
				}}})
				require.NoError(t, err)
				require.NotNil(t, res.GetResults()[0].GetResponse())
				for _, g := range got {
					ans := <-g
					require.NoError(t, ans.err)
					require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
				}
			})
		})
	}
}

// TestWaitPeerDown: a peerReplica that marked a record and died without
// leaving (SIGKILL: its row stays live until its heartbeat is old, and
// nothing answers on its address) costs the others nothing: the Complete
// through A answers, and the waiter on B is told all the same.
func TestWaitPeerDown(t *testing.T) {
	db := pgtest.NewDatabase(t)
	a, b := startPeer(t, db, replicaConfig(slowRecheck)), startPeer(t, db, replicaConfig(slowRecheck))
	seeEachOther(t, a, b)
	// The dead peerReplica: a live row whose address refuses connections,
	// and its mark on the record.
	dead := openPostgres(t, db)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	deadAddr := lis.Addr().String()
	require.NoError(t, lis.Close())
	require.NoError(t, dead.(storage.Membership).Heartbeat(t.Context(), storage.HeartbeatParams{ID: "killed", Address: deadAddr}))
	require.Eventually(t, func() bool { return len(a.srv.Members()) == 3 }, 10*time.Second, 5*time.Millisecond)

	holder, err := a.c.Claim(t.Context(), claimReq("k", "fp"))
	require.NoError(t, err)
	ok, err := dead.(storage.WaitMarker).MarkWaiting(t.Context(), storage.MarkWaitingParams{
		Key: storage.Key{Consumer: holder.GetRecord().GetConsumer(), Kind: storage.KindOperation, Key: "k"}, Token: holder.GetToken(), Replica: "killed"})
	require.NoError(t, err)
	require.True(t, ok)
	got := claimAsync(t.Context(), b.c, waiting("k", crossWait))
	b.waitersReach(t, 1)
	completeWith(t, a.c, holder, "k", "done")
	ans := <-got
	require.NoError(t, ans.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
}

// TestWaitPeerPartitioned: a peerReplica its peers cannot reach (its
// advertised address goes nowhere) is not told, and its waiters notice
// the Complete by their re-check, as before there was any telling.
func TestWaitPeerPartitioned(t *testing.T) {
	db := pgtest.NewDatabase(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	nowhere := lis.Addr().String()
	require.NoError(t, lis.Close())
	a := startPeer(t, db, replicaConfig(slowRecheck))
	cfg := replicaConfig(50 * time.Millisecond)
	cfg.Replica.AdvertiseAddress = nowhere
	b := startPeer(t, db, cfg)
	require.Eventually(t, func() bool { return len(a.srv.Members()) == 2 && len(b.srv.Members()) == 2 }, 10*time.Second, 5*time.Millisecond)

	holder, err := a.c.Claim(t.Context(), claimReq("k", "fp"))
	require.NoError(t, err)
	got := claimAsync(t.Context(), b.c, waiting("k", crossWait))
	b.waitersReach(t, 1)
	completeWith(t, a.c, holder, "k", "done")
	ans := <-got
	require.NoError(t, ans.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
}

// TestWaitReplicasJoinAndLeave: replicas join and leave while keys wait;
// the waiters on the replicas still there are told.
func TestWaitReplicasJoinAndLeave(t *testing.T) {
	db := pgtest.NewDatabase(t)
	a, b := startPeer(t, db, replicaConfig(slowRecheck)), startPeer(t, db, replicaConfig(slowRecheck))
	seeEachOther(t, a, b)
	holder, err := a.c.Claim(t.Context(), claimReq("k", "fp"))
	require.NoError(t, err)
	onB := claimAsync(t.Context(), b.c, waiting("k", crossWait))
	b.waitersReach(t, 1)

	c := startPeer(t, db, replicaConfig(slowRecheck)) // joins while k waits
	seeEachOther(t, a, b, c)
	onC := claimAsync(t.Context(), c.c, waiting("k", crossWait))
	c.waitersReach(t, 1)

	b.stop() // leaves while its Claim waits: the Claim answers as it is
	ans := <-onB
	if ans.err == nil {
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, ans.res.GetOutcome())
	}
	seeEachOther(t, a, c)

	completeWith(t, a.c, holder, "k", "done")
	ans = <-onC
	require.NoError(t, ans.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
}
