package server_test

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// waitHarness is a server whose waiters a test can count.
type waitHarness struct {
	srv  *server.Server
	c    idemregv1.RegistryServiceClient
	addr string
}

// newClient connects another client: a connection carries at most 64
// calls at once (server.Bounds), and a waiting Claim is one of them.
func (h waitHarness) newClient(t *testing.T) idemregv1.RegistryServiceClient {
	return idemregv1.NewRegistryServiceClient(servertest.Dial(t, h.addr))
}

func forEachWaitBackend(t *testing.T, cfg server.Config, fn func(t *testing.T, h waitHarness)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			addr, srv := servertest.Serve(t, b.open(t, &storagetest.Clock{}), cfg)
			fn(t, waitHarness{srv: srv, c: idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr)), addr: addr})
		})
	}
}

// waitersReach waits until n Claims wait on h's server.
func (h waitHarness) waitersReach(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return h.srv.Waiting() == n }, 10*time.Second, time.Millisecond, "%d waiters", n)
}

type claimAnswer struct {
	res *idemregv1.ClaimResponse
	err error
}

func claimAsync(ctx context.Context, c idemregv1.RegistryServiceClient, r *idemregv1.ClaimRequest) <-chan claimAnswer {
	out := make(chan claimAnswer, 1)
	go func() {
		res, err := c.Claim(ctx, r)
		out <- claimAnswer{res, err}
	}()
	return out
}

func waiting(key string, d time.Duration) *idemregv1.ClaimRequest {
	r := claimReq(key, "fp")
	r.Holder = "waiter"
	r.Wait = durationpb.New(d)
	return r
}

func completeWith(t *testing.T, c idemregv1.RegistryServiceClient, cl *idemregv1.ClaimResponse, key, result string) {
	t.Helper()
	r := claimReq(key, "")
	_, err := c.Complete(t.Context(), &idemregv1.CompleteRequest{Consumer: r.Consumer, Kind: r.Kind, Key: key,
		Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response(result)})
	require.NoError(t, err)
}

func TestWaitEndsWithTheResult(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		holder, err := h.c.Claim(t.Context(), claimReq("k", "fp"))
		require.NoError(t, err)
		got := claimAsync(t.Context(), h.c, waiting("k", 20*time.Second))
		h.waitersReach(t, 1)
		completeWith(t, h.c, holder, "k", "charged")
		a := <-got
		require.NoError(t, a.err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, a.res.GetOutcome())
		require.Equal(t, "charged", string(a.res.GetRecord().GetResult().GetResponse().GetData()))
		h.waitersReach(t, 0)
	})
}

func TestWaitTakesOverAfterRelease(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		r := claimReq("k", "fp")
		holder, err := h.c.Claim(t.Context(), r)
		require.NoError(t, err)
		got := claimAsync(t.Context(), h.c, waiting("k", 20*time.Second))
		h.waitersReach(t, 1)
		_, err = h.c.Release(t.Context(), &idemregv1.ReleaseRequest{Consumer: r.Consumer, Kind: r.Kind, Key: "k", Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret()})
		require.NoError(t, err)
		a := <-got
		require.NoError(t, a.err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, a.res.GetOutcome())
		require.EqualValues(t, 2, a.res.GetRecord().GetAttempt())
		require.Greater(t, a.res.GetToken(), holder.GetToken())
		completeWith(t, h.c, a.res, "k", "by the waiter")
	})
}

// TestWaitTakesOverAtLeaseEnd: nobody writes; the lease runs out.
func TestWaitTakesOverAtLeaseEnd(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		r := claimReq("k", "fp")
		r.Lease = durationpb.New(time.Second)
		_, err := h.c.Claim(t.Context(), r)
		require.NoError(t, err)
		a := <-claimAsync(t.Context(), h.c, waiting("k", 20*time.Second))
		require.NoError(t, a.err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, a.res.GetOutcome())
		require.EqualValues(t, 2, a.res.GetRecord().GetAttempt())
	})
}

func TestWaitElapses(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		_, err := h.c.Claim(t.Context(), claimReq("k", "fp"))
		require.NoError(t, err)
		start := time.Now()
		a := <-claimAsync(t.Context(), h.c, waiting("k", 300*time.Millisecond))
		require.NoError(t, a.err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, a.res.GetOutcome())
		require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond, "it waited")
		require.Positive(t, a.res.GetRetryAfter().AsDuration())
		require.Zero(t, a.res.GetRecord().GetToken())

		// Bounded by the deadline too: the answer comes before it.
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		a = <-claimAsync(ctx, h.c, waiting("k", 20*time.Second))
		require.NoError(t, a.err, "IN_PROGRESS before the deadline, not DEADLINE_EXCEEDED")
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, a.res.GetOutcome())

		// A fingerprint mismatch does not wait.
		other := waiting("k", 20*time.Second)
		other.Fingerprint = []byte("other")
		_, err = h.c.Claim(t.Context(), other)
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)

		// More than the maximum is refused.
		_, err = h.c.Claim(t.Context(), waiting("k", server.MaxWait+time.Second))
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"wait"}, violatedFields(st))
	})
}

// TestWaitersAreBounded: beyond MaxWaiters a Claim answers at once.
func TestWaitersAreBounded(t *testing.T) {
	forEachWaitBackend(t, server.Config{MaxWaiters: 2}, func(t *testing.T, h waitHarness) {
		_, err := h.c.Claim(t.Context(), claimReq("k", "fp"))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		first, second := claimAsync(ctx, h.c, waiting("k", 20*time.Second)), claimAsync(ctx, h.c, waiting("k", 20*time.Second))
		h.waitersReach(t, 2)
		a := <-claimAsync(t.Context(), h.c, waiting("k", 20*time.Second))
		require.NoError(t, a.err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, a.res.GetOutcome())
		cancel()
		for _, ch := range []<-chan claimAnswer{first, second} {
			require.Equal(t, codes.Canceled, status.Code((<-ch).err))
		}
		h.waitersReach(t, 0)
	})
}

// TestWaitLeavesNothingBehind: waits that end every way leave no goroutine
// or waiter behind.
func TestWaitLeavesNothingBehind(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		// Warm the connection and the server's workers first.
		_, err := h.c.Claim(t.Context(), claimReq("warm", ""))
		require.NoError(t, err)
		before := runtime.NumGoroutine()
		for round := range 3 {
			key := fmt.Sprintf("k-%d", round)
			holder, err := h.c.Claim(t.Context(), claimReq(key, "fp"))
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(t.Context())
			var answers []<-chan claimAnswer
			for range 20 {
				answers = append(answers, claimAsync(ctx, h.c, waiting(key, 20*time.Second)))
			}
			for range 5 {
				answers = append(answers, claimAsync(t.Context(), h.c, waiting(key, 50*time.Millisecond)))
			}
			h.waitersReach(t, 20)
			cancel()
			h.waitersReach(t, 0)
			completeWith(t, h.c, holder, key, "r")
			for _, ch := range answers {
				<-ch
			}
		}
		require.Eventually(t, func() bool { return runtime.NumGoroutine() <= before+2 }, 10*time.Second, 10*time.Millisecond,
			"goroutines: %d before, %d after", before, runtime.NumGoroutine())
	})
}

// TestRaceWaiters: 64 Claims wait on one key. When the holder completes,
// every one gets the result; when it releases, exactly one takes over, and
// when that one completes, all the others get its result.
func TestRaceWaiters(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		for _, release := range []bool{false, true} {
			key := fmt.Sprintf("k-release-%v", release)
			r := claimReq(key, "fp")
			holder, err := h.c.Claim(t.Context(), r)
			require.NoError(t, err)
			var answers []<-chan claimAnswer
			waiters := []idemregv1.RegistryServiceClient{h.newClient(t), h.newClient(t)}
			for i := range 64 {
				answers = append(answers, claimAsync(t.Context(), waiters[i%2], waiting(key, 20*time.Second)))
			}
			h.waitersReach(t, 64)
			want := "by the holder"
			if release {
				_, err = h.c.Release(t.Context(), &idemregv1.ReleaseRequest{Consumer: r.Consumer, Kind: r.Kind, Key: key, Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret()})
				require.NoError(t, err)
				want = "by the waiter that took over"
			} else {
				completeWith(t, h.c, holder, key, want)
			}
			acquired, completed := 0, 0
			var mu sync.Mutex
			var wg sync.WaitGroup
			for _, ch := range answers {
				wg.Go(func() {
					a := <-ch
					require.NoError(t, a.err)
					mu.Lock()
					defer mu.Unlock()
					switch a.res.GetOutcome() {
					case idemregv1.Outcome_OUTCOME_ACQUIRED:
						acquired++
						completeWith(t, h.c, a.res, key, want)
					case idemregv1.Outcome_OUTCOME_COMPLETED:
						completed++
						require.Equal(t, want, string(a.res.GetRecord().GetResult().GetResponse().GetData()))
					default:
						t.Errorf("a waiter answered %v", a.res.GetOutcome())
					}
				})
			}
			wg.Wait()
			if release {
				require.Equal(t, 1, acquired, "exactly one takes over")
				require.Equal(t, 63, completed)
			} else {
				require.Equal(t, 0, acquired)
				require.Equal(t, 64, completed)
			}
		}
	})
}

// TestWaitInBatch: a BatchClaim item waits like a Claim, the others answer.
func TestWaitInBatch(t *testing.T) {
	forEachWaitBackend(t, server.Config{}, func(t *testing.T, h waitHarness) {
		holder, err := h.c.Claim(t.Context(), claimReq("busy", "fp"))
		require.NoError(t, err)
		got := make(chan *idemregv1.BatchClaimResponse, 1)
		go func() {
			res, err := h.c.BatchClaim(t.Context(), &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
				claimReq("fresh", ""), waiting("busy", 20*time.Second),
			}})
			require.NoError(t, err)
			got <- res
		}()
		h.waitersReach(t, 1)
		completeWith(t, h.c, holder, "busy", "done")
		res := <-got
		fresh, err := claimResult(res.GetResults()[0])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, fresh.GetOutcome())
		busy, err := claimResult(res.GetResults()[1])
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, busy.GetOutcome())

		// A key the batch names twice does not wait: the second item is
		// decided after the first.
		h2, err := h.c.Claim(t.Context(), claimReq("busy-2", "fp"))
		require.NoError(t, err)
		twice, err := h.c.BatchClaim(t.Context(), &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
			waiting("busy-2", 20*time.Second), waiting("busy-2", 20*time.Second),
		}})
		require.NoError(t, err)
		for _, r := range twice.GetResults() {
			res, err := claimResult(r)
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, res.GetOutcome(), "answered at once")
		}
		completeWith(t, h.c, h2, "busy-2", "r")
	})
}

// TestWaitDrainsOnShutdown: a server shutting down answers its waiters.
func TestWaitDrainsOnShutdown(t *testing.T) {
	srv, err := server.New(memStore(t), server.Config{})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, lis) }()
	c := idemregv1.NewRegistryServiceClient(servertest.Dial(t, lis.Addr().String()))
	_, err = c.Claim(t.Context(), claimReq("k", "fp"))
	require.NoError(t, err)
	got := claimAsync(t.Context(), c, waiting("k", 25*time.Second))
	h := waitHarness{srv: srv, c: c}
	h.waitersReach(t, 1)
	cancel()
	a := <-got
	require.NoError(t, a.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, a.res.GetOutcome())
	require.NoError(t, <-served)
}

// TestWaitAcrossReplicas: two servers on one PostgreSQL database; a Claim
// waiting on one wakes when the key is completed through the other, by
// the re-check.
func TestWaitAcrossReplicas(t *testing.T) {
	db := pgtest.NewDatabase(t)
	addrA, srvA := servertest.Serve(t, openPostgres(t, db), server.Config{WaitRecheck: 20 * time.Millisecond})
	addrB, _ := servertest.Serve(t, openPostgres(t, db), server.Config{})
	a := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addrA))
	b := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addrB))
	holder, err := b.Claim(t.Context(), claimReq("k", "fp"))
	require.NoError(t, err)
	got := claimAsync(t.Context(), a, waiting("k", 20*time.Second))
	waitHarness{srv: srvA, c: a}.waitersReach(t, 1)
	completeWith(t, b, holder, "k", "through B")
	ans := <-got
	require.NoError(t, ans.err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, ans.res.GetOutcome())
	require.Equal(t, "through B", string(ans.res.GetRecord().GetResult().GetResponse().GetData()))
}

func openPostgres(t *testing.T, db string) storage.Store {
	t.Helper()
	s, err := postgres.Open(t.Context(), db)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}
