package adversarial

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// The peers' internal call (server/internal/peers): not in the API.
const (
	peersService = "idemreg.internal.peers.v1.Peers"
	wakeMethod   = "/" + peersService + "/Wake"
	wakeReplays  = 150 // within --refusal-rate's burst: each is answered at once
)

// replica is an idemreg serve of its own on a PostgreSQL database, for
// the cases that need two replicas (the suite's serve is one, on the
// embedded store).
type replica struct {
	c       idemregv1.RegistryServiceClient
	metrics *suite // only its metricsAddr: for metric
	mu      sync.Mutex
	stderr  bytes.Buffer
}

func (r *replica) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stderr.Write(p)
}

// lines counts the log lines that contain every one of parts.
func (r *replica) lines(parts ...string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for line := range strings.SplitSeq(r.stderr.String(), "\n") {
		match := line != ""
		for _, p := range parts {
			match = match && strings.Contains(line, p)
		}
		if match {
			n++
		}
	}
	return n
}

func startReplica(t *testing.T, db, advertise string) (*replica, string) {
	t.Helper()
	addr := servetest.FreeAddr(t)
	if advertise == "" {
		advertise = addr
	}
	r := &replica{metrics: &suite{metricsAddr: servetest.FreeAddr(t)}}
	servetest.StartWith(t, servetest.Options{Addr: addr, Args: []string{"--metrics-listen", r.metrics.metricsAddr,
		"--database-url", db, "--advertise-address", advertise, "--log-format", "json",
		"--heartbeat-interval", "100ms", "--member-live-for", "1s", "--wait-recheck", "30s",
		"--refusal-log-rate", fmt.Sprint(refusalLogRate)},
		Observe: func(text string, _ map[string]any) { _, _ = r.Write([]byte(text + "\n")) }})
	r.c = idemregv1.NewRegistryServiceClient(servetest.Dial(t, addr))
	require.Eventually(t, func() bool {
		_, err := r.metrics.metricValue("idemreg_claims_total")
		return err == nil
	}, 60*time.Second, 50*time.Millisecond, "serve on %s: %s", addr, r)
	return r, addr
}

func (r *replica) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stderr.String()
}

// tapWakes serves, on loopback, the peers' Wake for replica B: it keeps a
// copy of every sealed message and forwards it to B's listener, as anyone
// on the path between two replicas could.
type tapWakes struct {
	addr   string
	to     *grpc.ClientConn
	mu     sync.Mutex
	copies [][]byte
}

func startTap(t *testing.T) *tapWakes {
	t.Helper()
	tap := &tapWakes{}
	g := grpc.NewServer()
	g.RegisterService(&grpc.ServiceDesc{ServiceName: peersService, HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Wake", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.BytesValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			tap.mu.Lock()
			tap.copies = append(tap.copies, in.GetValue())
			to := tap.to
			tap.mu.Unlock()
			if to == nil {
				return nil, status.Error(codes.Unavailable, "no replica behind the tap yet")
			}
			out := new(emptypb.Empty)
			return out, to.Invoke(ctx, wakeMethod, in, out)
		}}}}, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	tap.addr = lis.Addr().String()
	return tap
}

func (tap *tapWakes) captured() [][]byte {
	tap.mu.Lock()
	defer tap.mu.Unlock()
	return append([][]byte(nil), tap.copies...)
}

// wakeReplay (issue 35, weakness 3): two more serves, A and B, on one
// PostgreSQL database; B advertises a tap that keeps the Wakes A sends
// it. A Release through A wakes a Claim waiting on B (the captured Wake);
// then, with another Claim waiting on B, the captured Wake is sent to B
// 150 times. Bound: each replay is PERMISSION_DENIED with ErrorInfo
// PERMISSION_DENIED and wake=replayed, counted in
// idemreg_peer_wakes_received_total{result="replayed"}; the waiter
// decides with the store only once more, when the attempt really ends
// (idemreg_claims_total); B writes at most --refusal-log-rate lines a
// second for them. Before: every replay was taken, each an INFO line,
// and each made the waiters decide again.
func wakeReplay(t *testing.T, s *suite) {
	db := pgtest.NewDatabase(t)
	tap := startTap(t)
	a, _ := startReplica(t, db, "")
	b, bAddr := startReplica(t, db, tap.addr)
	tap.mu.Lock()
	tap.to = servetest.Dial(t, bAddr)
	tap.mu.Unlock()
	ctx := t.Context()
	claimOn := func(key, holder string, wait time.Duration) *idemregv1.ClaimRequest {
		r := claim("wake.replay", key)
		r.Holder = holder
		if wait > 0 {
			r.Wait = durationpb.New(wait)
		}
		return r
	}
	// waitOnB starts a Claim waiting on B and returns once B decided it
	// in progress (it sleeps just after).
	waitOnB := func(key string) <-chan *idemregv1.ClaimResponse {
		before := b.metrics.metric(t, "idemreg_claims_total", `outcome="in_progress"`)
		out := make(chan *idemregv1.ClaimResponse, 1)
		go func() {
			res, err := b.c.Claim(ctx, claimOn(key, "waiter", 8*time.Second))
			if err != nil {
				t.Errorf("waiting Claim: %v", err)
			}
			out <- res
		}()
		require.Eventually(t, func() bool {
			return b.metrics.metricNoTest("idemreg_claims_total", `outcome="in_progress"`) > before
		}, 10*time.Second, 5*time.Millisecond)
		return out
	}

	// A genuine Wake: until the replicas see each other, A tells nobody
	// and B's waiter notices at its re-check; so try new keys until one
	// is told.
	var (
		key  string
		took *idemregv1.ClaimResponse
	)
	for deadline := time.Now().Add(30 * time.Second); len(tap.captured()) == 0; {
		require.True(t, time.Now().Before(deadline), "A never told B through the tap")
		key = fmt.Sprintf("k-%d", time.Now().UnixNano())
		holder, err := a.c.Claim(ctx, claimOn(key, "holder", 0))
		require.NoError(t, err)
		woken := waitOnB(key)
		_, err = a.c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "wake.replay", Kind: op, Key: key,
			Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret()})
		require.NoError(t, err)
		took = <-woken // told, or at its re-check of the lease it took over
	}
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, took.GetOutcome())
	wake := tap.captured()[0]

	second := waitOnB(key)
	claimsBefore := b.metrics.metric(t, "idemreg_claims_total")
	replayedBefore := b.metrics.metric(t, "idemreg_peer_wakes_received_total", `result="replayed"`)
	start := time.Now()
	for range wakeReplays {
		err := tap.to.Invoke(ctx, wakeMethod, wrapperspb.Bytes(wake), new(emptypb.Empty))
		st := status.Convert(err)
		require.Equal(t, codes.PermissionDenied, st.Code(), "%v", err)
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			if i, ok := d.(*errdetails.ErrorInfo); ok {
				info = i
			}
		}
		require.NotNil(t, info, "%v", err)
		require.Equal(t, idemregv1.ReasonPermissionDenied, info.GetReason())
		require.Equal(t, "replayed", info.GetMetadata()["wake"])
	}
	took2 := time.Since(start)

	_, err := b.c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "wake.replay", Kind: op, Key: key,
		Token: took.GetToken(), ClaimSecret: took.GetClaimSecret()})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, (<-second).GetOutcome())
	claims := b.metrics.metric(t, "idemreg_claims_total") - claimsBefore
	replayed := b.metrics.metric(t, "idemreg_peer_wakes_received_total", `result="replayed"`) - replayedBefore
	lines := b.lines(`"grpc.method":"Wake"`, `"grpc.code":"PERMISSION_DENIED"`)
	bound := refusalLogRate * (int(took2.Seconds()) + 2)
	t.Logf("%d replays in %v: %.0f refused as replayed, %.0f Claims of the waiter (its last decision), %d log lines (bound %d)",
		wakeReplays, took2.Round(time.Millisecond), replayed, claims, lines, bound)
	require.Equal(t, float64(wakeReplays), replayed, "every replay refused and counted")
	require.Equal(t, float64(1), claims, "the waiter decided again only when the attempt ended")
	require.LessOrEqual(t, lines, bound, "the replays' lines are sampled")
}
