package adversarial

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// The neighbour's loop: a few workers of tenant beta, each Claiming a new
// key and Completing it, for a window or a number of pairs, whichever
// comes first.
const (
	neighbourConsumer = "beta.neighbour"
	neighbourWorkers  = 4
	neighbourWindow   = 1500 * time.Millisecond
	neighbourMaxPairs = 50_000
)

// ack is a Complete the neighbour was told succeeded.
type ack struct {
	key   string
	token int64
	data  string
}

type neighbour struct {
	c    idemregv1.RegistryServiceClient
	next atomic.Int64

	mu    sync.Mutex
	acked []ack // every acknowledged Complete of the run, all cases
	first []string
}

// loop runs the neighbour's workers for window and returns the pairs it
// completed, the Completes acknowledged and the calls that failed, by code.
func (n *neighbour) loop(ctx context.Context, window time.Duration) (pairs int, acks []ack, failed map[codes.Code]int, took time.Duration) {
	ctx = asBeta(ctx)
	var (
		mu    sync.Mutex
		done  atomic.Int64
		wg    sync.WaitGroup
		start = time.Now()
		end   = start.Add(window)
	)
	failed = map[codes.Code]int{}
	fail := func(err error) {
		mu.Lock()
		if failed[status.Code(err)] == 0 {
			n.first = append(n.first, err.Error())
		}
		failed[status.Code(err)]++
		mu.Unlock()
	}
	// Each call has a deadline of its own, not the window's end: a call
	// near the end would get a store deadline of a few milliseconds.
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 10*time.Second) }
	for range neighbourWorkers {
		wg.Go(func() {
			for done.Load() < neighbourMaxPairs && time.Now().Before(end) && ctx.Err() == nil {
				key := fmt.Sprintf("n-%d", n.next.Add(1))
				cctx, cancel := call()
				res, err := n.c.Claim(cctx, claim(neighbourConsumer, key))
				cancel()
				if err != nil {
					fail(err)
					continue
				}
				data := "result-of-" + key
				cctx, cancel = call()
				_, err = n.c.Complete(cctx, &idemregv1.CompleteRequest{Consumer: neighbourConsumer, Kind: op, Key: key,
					Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Result: response(data)})
				cancel()
				if err != nil {
					fail(err)
					continue
				}
				done.Add(1)
				mu.Lock()
				acks = append(acks, ack{key: key, token: res.GetToken(), data: data})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	n.mu.Lock()
	n.acked = append(n.acked, acks...)
	n.mu.Unlock()
	return int(done.Load()), acks, failed, time.Since(start)
}

// requireReplayed checks that every acknowledged Complete is there: a
// Lookup finds it completed with its token and result, and a Claim (of
// every tenth, to keep it short) replays the result instead of acquiring.
func (n *neighbour) requireReplayed(t *testing.T, acks []ack) {
	t.Helper()
	ctx, cancel := context.WithTimeout(asBeta(t.Context()), 60*time.Second)
	defer cancel()
	for i, a := range acks {
		got, err := n.c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: neighbourConsumer, Kind: op, Key: a.key})
		require.NoError(t, err, "acknowledged Complete of %s lost", a.key)
		r := got.GetRecord()
		require.Equal(t, idemregv1.State_STATE_COMPLETED, r.GetState(), "key %s", a.key)
		require.Equal(t, a.token, r.GetToken(), "key %s", a.key)
		require.Equal(t, a.data, string(r.GetResult().GetResponse().GetData()), "key %s", a.key)
		if i%10 != 0 {
			continue
		}
		res, err := n.c.Claim(ctx, claim(neighbourConsumer, a.key))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome(), "key %s", a.key)
		require.Equal(t, a.data, string(res.GetRecord().GetResult().GetResponse().GetData()), "key %s", a.key)
	}
}

// underAttack measures the neighbour alone, then while attack runs, and
// checks that every Complete it was acknowledged under the attack
// replays and that it kept at least minShare of its throughput alone
// (no bound when minShare is 0: the case says why). attack runs until its
// context ends and must bound its own loops; it calls ready once its
// first wave is out, and the neighbour starts then.
func (s *suite) underAttack(t *testing.T, minShare float64, attack func(ctx context.Context, ready func())) {
	t.Helper()
	n := s.neighbour
	alonePairs, _, aloneFailed, aloneTook := n.loop(t.Context(), neighbourWindow)
	require.Positive(t, alonePairs, "the neighbour completes nothing alone: %v", aloneFailed)

	ctx, stop := context.WithCancel(t.Context())
	defer stop()
	ready := make(chan struct{})
	var once sync.Once
	attacked := make(chan struct{})
	go func() {
		defer close(attacked)
		attack(ctx, func() { once.Do(func() { close(ready) }) })
	}()
	select {
	case <-ready:
	case <-attacked:
		t.Fatal("the attack ended before it was ready")
	case <-time.After(60 * time.Second):
		t.Fatal("the attack was not ready in 60 s")
	}
	pairs, acks, failed, took := n.loop(t.Context(), neighbourWindow)
	stop()
	select {
	case <-attacked:
	case <-time.After(60 * time.Second):
		t.Fatal("the attack did not stop within 60 s of its end")
	}

	alone := float64(alonePairs) / aloneTook.Seconds()
	under := float64(pairs) / took.Seconds()
	share := under / alone
	t.Logf("neighbour: %.0f pairs/s alone, %.0f under attack (%.0f%%); failed alone %v, under attack %v; %d acknowledged Completes checked",
		alone, under, 100*share, aloneFailed, failed, len(acks))
	if len(n.first) > 0 {
		t.Logf("neighbour's first failure of each code: %q", n.first)
		n.first = nil
	}
	for code := range failed {
		require.NotContains(t, []codes.Code{codes.Internal, codes.Unknown, codes.DataLoss}, code, "the neighbour got %v", failed)
	}
	n.requireReplayed(t, acks)
	if minShare > 0 {
		require.GreaterOrEqual(t, share, minShare, "the neighbour kept %.0f%% of its throughput alone, the bound is %.0f%%", 100*share, 100*minShare)
	}
}
