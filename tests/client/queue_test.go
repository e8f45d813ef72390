package client_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"path"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// received is what a registry was sent, seen by a server-side interceptor
// before each call is decided: the calls by method, and the kinds of each
// Batch's items. holdNext holds the next call it receives.
type received struct {
	mu      sync.Mutex
	calls   map[string]int
	batches [][]string // each Batch's items: "claim" or "complete"
	gate    *gate      // holds the next call when set
}

// gate holds a call: held is closed when the call is held, and the call
// goes on when release is closed.
type gate struct {
	held, release chan struct{}
	once          sync.Once
}

func (g *gate) open() { g.once.Do(func() { close(g.release) }) }

// holdNext holds the next call the registry receives until the gate is
// opened (at the latest when the test ends).
func (r *received) holdNext(t testing.TB) *gate {
	g := &gate{held: make(chan struct{}), release: make(chan struct{})}
	r.mu.Lock()
	r.gate = g
	r.mu.Unlock()
	t.Cleanup(g.open)
	return g
}

func (r *received) count(method string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[method]
}

func (r *received) batchShapes() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([][]string(nil), r.batches...)
}

func (r *received) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	r.mu.Lock()
	r.calls[path.Base(info.FullMethod)]++
	if b, ok := req.(*idemregv1.BatchRequest); ok {
		var kinds []string
		for _, it := range b.GetItems() {
			switch {
			case it.GetClaim() != nil:
				kinds = append(kinds, "claim")
			case it.GetComplete() != nil:
				kinds = append(kinds, "complete")
			}
		}
		r.batches = append(r.batches, kinds)
	}
	g := r.gate
	r.gate = nil
	r.mu.Unlock()
	if g != nil {
		close(g.held)
		<-g.release
	}
	return next(ctx, req)
}

// oldRegistry is a registry that predates the Batch RPC: the real service,
// but Batch answers UNIMPLEMENTED, as an older server's generated code does.
type oldRegistry struct{ *server.Service }

func (oldRegistry) Batch(context.Context, *idemregv1.BatchRequest) (*idemregv1.BatchResponse, error) {
	return nil, status.Error(codes.Unimplemented, "method Batch not implemented")
}

// serveCounted runs the registry's service over the embedded store in
// memory, behind an interceptor that records what it is sent, and returns
// a client of it with batching b. old makes it a registry without Batch.
func serveCounted(t testing.TB, old bool, b client.Batching) (*client.Client, *received) {
	t.Helper()
	store, err := pebble.Open("", pebble.WithInMemory(), pebble.WithLogger(slog.New(slog.DiscardHandler)))
	require.NoError(t, err)
	svc, err := server.NewService(store, server.DefaultLimits(), nil)
	require.NoError(t, err)
	rec := &received{calls: map[string]int{}}
	gs := grpc.NewServer(grpc.UnaryInterceptor(rec.intercept))
	var impl idemregv1.RegistryServiceServer = svc
	if old {
		impl = oldRegistry{svc}
	}
	idemregv1.RegisterRegistryServiceServer(gs, impl)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(func() {
		gs.Stop()
		require.NoError(t, store.Close())
	})
	return client.New(servertest.Dial(t, lis.Addr().String()), client.WithBatching(b)), rec
}

// queuedCalls is how many goroutines wait in a Client's queue for an RPC
// to take their call: blocked in the coalescer's select, seen in the
// goroutines' stacks. Tests wait on it instead of sleeping; they do not
// run in parallel, so the only queues are their own.
func queuedCalls() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		header, rest, _ := strings.Cut(g, "\n")
		if strings.Contains(header, "[select") && strings.HasPrefix(rest, "github.com/idemreg/idemreg/client.(*coalescer).do(") {
			n++
		}
	}
	return n
}

func waitQueued(t *testing.T, n int) {
	t.Helper()
	eventually(t, func() bool { return queuedCalls() >= n }, fmt.Sprintf("%d calls queued", n))
}

func qkey(k string) client.Key { return client.Key{Consumer: inbox, Kind: client.KindMessage, Key: k} }

// TestQueueSharesOneBatch: Claims and Completes that queue while the
// client's RPCs are out go together in one Batch, each answered as its own
// call; a Complete with a stale fence fails alone (ErrLeaseLost) and the
// items beside it are decided; sequential calls are unary RPCs.
func TestQueueSharesOneBatch(t *testing.T) {
	c, rec := serveCounted(t, false, client.Batching{MaxInFlight: 1})
	ctx := t.Context()

	const n = 12
	fences := make([]client.Fence, n)
	for i := range n {
		cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(fmt.Sprint("done", i))})
		require.NoError(t, err)
		fences[i] = cl.Fence()
	}
	stale, err := c.Claim(ctx, client.ClaimParams{Key: qkey("stale")})
	require.NoError(t, err)
	_, err = c.Release(ctx, qkey("stale"), stale.Fence())
	require.NoError(t, err)
	again, err := c.Claim(ctx, client.ClaimParams{Key: qkey("stale")})
	require.NoError(t, err)
	require.Equal(t, n+2, rec.count("Claim"))
	require.Zero(t, rec.count("Batch"), "sequential calls are never batched")

	// Hold one call in flight (the cap is 1) and let the others queue.
	g := rec.holdNext(t)
	go func() { _, _ = c.Claim(ctx, client.ClaimParams{Key: qkey("gate")}) }()
	recv(t, g.held)

	type answer struct {
		rec client.Record
		cl  client.Claim
		err error
	}
	completes := make([]chan answer, n)
	claims := make([]chan answer, n)
	for i := range n {
		completes[i] = make(chan answer, 1)
		claims[i] = make(chan answer, 1)
		go func() {
			r, err := c.Complete(ctx, qkey(fmt.Sprint("done", i)), fences[i], client.ResponseResult("t", []byte{byte(i)}))
			completes[i] <- answer{rec: r, err: err}
		}()
		go func() {
			cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(fmt.Sprint("new", i))})
			claims[i] <- answer{cl: cl, err: err}
		}()
	}
	staleDone := make(chan error, 1)
	go func() {
		_, err := c.Complete(ctx, qkey("stale"), stale.Fence(), client.ResponseResult("t", []byte("late")))
		staleDone <- err
	}()
	waitQueued(t, 2*n+1)
	g.open()

	for i := range n {
		a := recv(t, completes[i])
		require.NoError(t, a.err)
		require.Equal(t, client.StateCompleted, a.rec.State)
		require.Equal(t, []byte{byte(i)}, a.rec.Result.Response.Data, "each Complete stored its own result")
		a = recv(t, claims[i])
		require.NoError(t, a.err)
		require.Equal(t, client.OutcomeAcquired, a.cl.Outcome)
		require.Equal(t, fmt.Sprint("new", i), a.cl.Record.Key.Key, "each caller gets its own answer")
	}
	require.ErrorIs(t, recv(t, staleDone), client.ErrLeaseLost, "only the stale fence's caller fails")

	shapes := rec.batchShapes()
	require.Len(t, shapes, 1, "everything that queued went in one Batch")
	require.Len(t, shapes[0], 2*n+1)
	require.Contains(t, shapes[0], "claim")
	require.Contains(t, shapes[0], "complete")
	require.Zero(t, rec.count("BatchClaim")+rec.count("BatchComplete"), "a registry with Batch gets no batch by kind")

	// The stale Complete changed nothing: the key is still the new holder's.
	live, err := c.Complete(ctx, qkey("stale"), again.Fence(), client.ResponseResult("t", []byte("holder's")))
	require.NoError(t, err)
	require.Equal(t, []byte("holder's"), live.Result.Response.Data)
}

// TestQueueCallerGivesUp: a queued caller whose context ends returns at
// once, before any RPC takes its call, and its item is never sent; the
// callers queued beside it are answered.
func TestQueueCallerGivesUp(t *testing.T) {
	c, rec := serveCounted(t, false, client.Batching{MaxInFlight: 1})
	ctx := t.Context()
	g := rec.holdNext(t)
	go func() { _, _ = c.Claim(ctx, client.ClaimParams{Key: qkey("gate")}) }()
	recv(t, g.held)

	claim := func(ctx context.Context, k string) chan error {
		ch := make(chan error, 1)
		go func() {
			cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(k)})
			if err == nil && cl.Outcome != client.OutcomeAcquired {
				err = fmt.Errorf("outcome %v", cl.Outcome)
			}
			ch <- err
		}()
		return ch
	}
	// The first queued would have sent the next RPC.
	cancelled, cancel := context.WithCancel(ctx)
	gone := claim(cancelled, "cancelled")
	waitQueued(t, 1)
	kept := claim(ctx, "kept")
	short, cancelShort := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancelShort()
	late := claim(short, "deadline")
	kept2 := claim(ctx, "kept2")
	waitQueued(t, 3)
	cancel()
	require.ErrorIs(t, recv(t, gone), client.ErrCanceled, "the cancelled caller returns while the RPC is still held")
	require.ErrorIs(t, recv(t, late), client.ErrDeadlineExceeded, "its own deadline holds")
	g.open()
	require.NoError(t, recv(t, kept))
	require.NoError(t, recv(t, kept2))
	require.Equal(t, [][]string{{"claim", "claim"}}, rec.batchShapes(), "the callers that gave up were not sent")
	for _, k := range []string{"cancelled", "deadline"} {
		_, err := c.Lookup(ctx, qkey(k))
		require.ErrorIs(t, err, client.ErrNotFound, "a caller that gave up before its call was sent claims nothing")
	}
}

// TestQueueKeepsKeyOrder: a Complete and then a Claim of one key, queued
// in that order by two callers, are decided in that order (the Claim
// finds the completed record), in one Batch, or, by a registry without
// Batch, in BatchClaims and BatchCompletes sent in rounds; such a registry
// is asked for Batch once.
func TestQueueKeepsKeyOrder(t *testing.T) {
	for _, tc := range []struct {
		name string
		old  bool
	}{{"batch", false}, {"without batch", true}} {
		t.Run(tc.name, func(t *testing.T) {
			c, rec := serveCounted(t, tc.old, client.Batching{MaxInFlight: 1})
			ctx := t.Context()
			fences := map[string]client.Fence{}
			for _, k := range []string{"k", "c1", "c2"} {
				cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(k)})
				require.NoError(t, err)
				fences[k] = cl.Fence()
			}
			g := rec.holdNext(t)
			go func() { _, _ = c.Claim(ctx, client.ClaimParams{Key: qkey("gate")}) }()
			recv(t, g.held)

			type answer struct {
				cl  client.Claim
				rec client.Record
				err error
			}
			var out []chan answer
			complete := func(k string) {
				ch := make(chan answer, 1)
				go func() {
					r, err := c.Complete(ctx, qkey(k), fences[k], client.ResponseResult("t", []byte("of "+k)))
					ch <- answer{rec: r, err: err}
				}()
				out = append(out, ch)
				waitQueued(t, len(out))
			}
			claim := func(k string) {
				ch := make(chan answer, 1)
				go func() {
					cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(k)})
					ch <- answer{cl: cl, err: err}
				}()
				out = append(out, ch)
				waitQueued(t, len(out))
			}
			complete("k")
			complete("c1")
			claim("n1")
			claim("k")
			claim("n2")
			complete("c2")
			g.open()

			var got []answer
			for _, ch := range out {
				a := recv(t, ch)
				require.NoError(t, a.err)
				got = append(got, a)
			}
			require.Equal(t, client.OutcomeCompleted, got[3].cl.Outcome, "the Claim queued after the key's Complete finds it completed")
			require.Equal(t, []byte("of k"), got[3].cl.Record.Result.Response.Data)
			require.Equal(t, client.OutcomeAcquired, got[2].cl.Outcome)
			require.Equal(t, client.OutcomeAcquired, got[4].cl.Outcome)
			for _, i := range []int{0, 1, 5} {
				require.Equal(t, client.StateCompleted, got[i].rec.State)
			}
			if !tc.old {
				require.Equal(t, [][]string{{"complete", "complete", "claim", "claim", "claim", "complete"}}, rec.batchShapes(), "one Batch, in the order the calls queued")
				require.Zero(t, rec.count("BatchClaim")+rec.count("BatchComplete"))
				return
			}
			require.Equal(t, 1, rec.count("Batch"))
			// Rounds: {Complete k, Complete c1, Claim n1}, then {Claim k, Claim n2, Complete c2}.
			require.Equal(t, 1, rec.count("BatchComplete"))
			require.Equal(t, 1, rec.count("BatchClaim"))

			// From then on the client does not ask for Batch again.
			g = rec.holdNext(t)
			go func() { _, _ = c.Claim(ctx, client.ClaimParams{Key: qkey("gate2")}) }()
			recv(t, g.held)
			out = nil
			fences["n1"] = got[2].cl.Fence()
			claim("n3")
			claim("n4")
			complete("n1")
			g.open()
			for _, ch := range out {
				require.NoError(t, recv(t, ch).err)
			}
			require.Equal(t, 1, rec.count("Batch"), "UNIMPLEMENTED is remembered")
			require.Equal(t, 2, rec.count("BatchClaim"))
		})
	}
}

// TestQueueRace: many callers on few keys, through one Client with one or
// two RPCs in flight, some giving up at random: each key is acquired by
// one caller at most, its Complete goes through, and every answer that
// finds the key completed carries that caller's result. Run with -race.
func TestQueueRace(t *testing.T) {
	for _, inFlight := range []int{1, 2} {
		t.Run(fmt.Sprint("in flight ", inFlight), func(t *testing.T) {
			c, rec := serveCounted(t, false, client.Batching{MaxInFlight: inFlight})
			const workers, rounds, keys = 16, 40, 24
			var (
				mu       sync.Mutex
				acquired = map[string]int{}
				stored   = map[string][]byte{}
			)
			var wg sync.WaitGroup
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rnd := rand.New(rand.NewPCG(uint64(w), 36))
					for r := range rounds {
						k := fmt.Sprint("k", rnd.IntN(keys))
						ctx, cancel := context.WithCancel(t.Context())
						if rnd.IntN(8) == 0 {
							cancel() // gives up before or while queued
						}
						cl, err := c.Claim(ctx, client.ClaimParams{Key: qkey(k)})
						cancel()
						if err != nil {
							assert.ErrorIs(t, err, client.ErrCanceled)
							continue
						}
						switch cl.Outcome {
						case client.OutcomeAcquired:
							mu.Lock()
							acquired[k]++
							mu.Unlock()
							data := []byte(fmt.Sprint(w, "/", r))
							done, err := c.Complete(t.Context(), qkey(k), cl.Fence(), client.ResponseResult("t", data))
							if assert.NoError(t, err) {
								assert.Equal(t, data, done.Result.Response.Data)
								mu.Lock()
								stored[k] = data
								mu.Unlock()
							}
						case client.OutcomeCompleted:
							mu.Lock()
							want, ok := stored[k]
							mu.Unlock()
							if ok {
								assert.Equal(t, want, cl.Record.Result.Response.Data, "a completed key answers its one result")
							}
						case client.OutcomeInProgress:
						default:
							t.Errorf("outcome %v", cl.Outcome)
						}
					}
				}()
			}
			wg.Wait()
			for k, n := range acquired {
				require.Equal(t, 1, n, "key %s acquired once", k)
			}
			for k, want := range stored {
				cl, err := c.Claim(t.Context(), client.ClaimParams{Key: qkey(k)})
				require.NoError(t, err)
				require.Equal(t, client.OutcomeCompleted, cl.Outcome)
				require.Equal(t, want, cl.Record.Result.Response.Data)
			}
			t.Logf("%d Batch, %d Claim, %d Complete RPCs for %d calls", rec.count("Batch"), rec.count("Claim"), rec.count("Complete"), workers*rounds)
		})
	}
}
