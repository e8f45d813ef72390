package server_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/internal/peers"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

const wakeMethod = "/" + peers.ServiceName + "/Wake"

// wakeTap is a gRPC server on loopback between the replicas: B advertises
// its address, so A's Wakes for B pass through it, and it keeps each
// sealed message it forwards, as anyone on the path could.
type wakeTap struct {
	addr   string
	mu     sync.Mutex
	to     *grpc.ClientConn // B's own listener
	copies [][]byte
}

func startWakeTap(t *testing.T) *wakeTap {
	t.Helper()
	tap := &wakeTap{}
	g := grpc.NewServer()
	g.RegisterService(&grpc.ServiceDesc{
		ServiceName: peers.ServiceName,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Wake", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.BytesValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			tap.mu.Lock()
			tap.copies = append(tap.copies, in.GetValue())
			to := tap.to
			tap.mu.Unlock()
			out := new(emptypb.Empty)
			return out, to.Invoke(ctx, wakeMethod, in, out)
		}}},
	}, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	tap.addr = lis.Addr().String()
	return tap
}

func (tap *wakeTap) forwardTo(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	tap.mu.Lock()
	tap.to = conn
	tap.mu.Unlock()
	return conn
}

func (tap *wakeTap) captured() [][]byte {
	tap.mu.Lock()
	defer tap.mu.Unlock()
	return append([][]byte(nil), tap.copies...)
}

// TestWakeReplayRefusedAcrossReplicas (issue 35, weakness 3): a Wake
// captured between two replicas and sent again to its receiver, 50 times,
// while a Claim waits there on the key it names: each replay is refused
// PERMISSION_DENIED (reason PERMISSION_DENIED, wake=replayed) and counted
// in idemreg.peer.wakes.received, the waiter decides no more than without
// the replays (one Claim of the store, when the attempt really ends), and
// the replays' access log lines are sampled. Before, every replay was
// taken: each made the waiters decide again with the store, and each was
// an unsampled line.
func TestWakeReplayRefusedAcrossReplicas(t *testing.T) {
	db := pgtest.NewDatabase(t)
	tap := startWakeTap(t)
	var logs syncBuffer
	reader := sdkmetric.NewManualReader()
	bcfg := replicaConfig(slowRecheck)
	bcfg.Replica.AdvertiseAddress = tap.addr
	bcfg.Logger = jsonLogger(&logs)
	bcfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	a := startPeer(t, db, replicaConfig(slowRecheck))
	b := startPeer(t, db, bcfg)
	toB := tap.forwardTo(t, b.addr)
	// Connected before A's first Wake, which has DefaultTimeout (250 ms)
	// for the tap's forwarding too.
	toB.Connect()
	require.Eventually(t, func() bool { return toB.GetState() == connectivity.Ready }, 10*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return len(a.srv.Members()) == 2 && len(b.srv.Members()) == 2 }, 10*time.Second, 5*time.Millisecond)

	// A genuine Wake: A releases the key a Claim waits for on B.
	holder, err := a.c.Claim(t.Context(), claimReq("replayed", "fp"))
	require.NoError(t, err)
	first := claimAsync(t.Context(), b.c, waiting("replayed", crossWait))
	b.waitersReach(t, 1)
	_, err = a.c.Release(t.Context(), &idemregv1.ReleaseRequest{Consumer: holder.GetRecord().GetConsumer(), Kind: idemregv1.Kind_KIND_OPERATION,
		Key: "replayed", Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret()})
	require.NoError(t, err)
	took := <-first
	require.NoError(t, took.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, took.res.GetOutcome(), "woken by A's Wake")
	wakes := tap.captured()
	require.Len(t, wakes, 1)

	// Another Claim waits on B for the attempt the first one took.
	second := claimAsync(t.Context(), b.c, waiting("replayed", crossWait))
	b.waitersReach(t, 1)
	claimsBefore := sumOf(collectSums(t, reader), server.MetricClaims)
	const replays = 50
	start := time.Now()
	for range replays {
		err := toB.Invoke(t.Context(), wakeMethod, wrapperspb.Bytes(wakes[0]), new(emptypb.Empty))
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
		info := detail[*errdetails.ErrorInfo](t, err)
		require.Equal(t, idemregv1.ReasonPermissionDenied, info.GetReason())
		require.Equal(t, peers.Replayed, info.GetMetadata()["wake"])
	}
	end := time.Now()

	// The attempt ends through B: its waiter decides once, and takes over.
	_, err = b.c.Release(t.Context(), &idemregv1.ReleaseRequest{Consumer: took.res.GetRecord().GetConsumer(), Kind: idemregv1.Kind_KIND_OPERATION,
		Key: "replayed", Token: took.res.GetToken(), ClaimSecret: took.res.GetClaimSecret()})
	require.NoError(t, err)
	ans := <-second
	require.NoError(t, ans.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, ans.res.GetOutcome())
	sums := collectSums(t, reader)
	require.Equal(t, int64(1), sumOf(sums, server.MetricClaims)-claimsBefore,
		"the waiter decided again only when the attempt ended, not for a replay")
	require.Equal(t, int64(replays), sums[server.MetricPeerWakesReceived+" result=replayed"])
	require.Equal(t, int64(1), sums[server.MetricPeerWakesReceived+" result=woken"])

	// Each replay's line is written or counted as left out, at most
	// DefaultRefusalLogRate lines a second.
	var lines int
	require.Eventually(t, func() bool {
		lines = 0
		for _, l := range logs.lines(t, "finished call") {
			if l["grpc.method"] == "Wake" && l["grpc.code"] == "PERMISSION_DENIED" {
				lines++
			}
		}
		out := collectSums(t, reader)[server.MetricLogSampled+" code=PERMISSION_DENIED"]
		return int64(lines)+out >= replays
	}, 10*time.Second, 5*time.Millisecond)
	seconds := int(end.Unix()-start.Unix()) + 1
	require.LessOrEqual(t, lines, server.DefaultRefusalLogRate*seconds, "the replays' lines are sampled")
}

// sumOf adds the sums of name, whatever their attributes.
func sumOf(sums map[string]int64, name string) int64 {
	var n int64
	for k, v := range sums {
		if k == name || len(k) > len(name) && k[:len(name)+1] == name+" " {
			n += v
		}
	}
	return n
}
