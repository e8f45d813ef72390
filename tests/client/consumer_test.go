package client_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// batchLog records the items of every Batch a client sends, and every
// other registry call by method.
type batchLog struct {
	mu      sync.Mutex
	batches [][]string // "claim:<key>" / "complete:<key>"
	calls   map[string]int
}

func (l *batchLog) interceptor(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	l.mu.Lock()
	l.calls[method[len("/idemreg.v1.RegistryService/"):]]++
	if b, ok := req.(*idemregv1.BatchRequest); ok {
		var items []string
		for _, it := range b.GetItems() {
			if c := it.GetClaim(); c != nil {
				items = append(items, "claim:"+c.GetKey())
			} else {
				items = append(items, "complete:"+it.GetComplete().GetKey())
			}
		}
		l.batches = append(l.batches, items)
	}
	l.mu.Unlock()
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (l *batchLog) snapshot() ([][]string, map[string]int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	calls := make(map[string]int, len(l.calls))
	for k, v := range l.calls {
		calls[k] = v
	}
	return append([][]string(nil), l.batches...), calls
}

func loggedClient(t *testing.T, addr string) (*client.Client, *batchLog) {
	t.Helper()
	l := &batchLog{calls: map[string]int{}}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(l.interceptor))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return client.New(conn), l
}

// A lone consumer loop makes one RPC per message: the Complete of each
// message goes in the Batch of the next message's Claim, and the last one
// goes alone on Close.
func TestConsumerCompleteRidesWithNextClaim(t *testing.T) {
	reg := inprocess.Start(t)
	c, log := loggedClient(t, reg.Addr)
	// No linger runs out within the test: only the next Claim or Close sends.
	cons := c.Consumer("orders.pipelined", client.WithLinger(time.Hour))

	var dones []*client.Done
	for i := range 3 {
		res, d, err := cons.Handle(t.Context(), fmt.Sprintf("m%d", i), func(ctx context.Context, a client.Attempt) ([]byte, error) {
			return []byte(a.Key.Key), nil
		})
		require.NoError(t, err)
		require.True(t, res.Ran)
		dones = append(dones, d)
	}
	// m0 and m1 were carried by the next Claims; m2 is still held.
	require.NoError(t, recv(t, chanOf(dones[0])))
	require.NoError(t, recv(t, chanOf(dones[1])))
	select {
	case <-dones[2].Ready():
		t.Fatal("the last Complete went out without a Claim, a wait or a flush")
	default:
	}
	require.NoError(t, cons.Close(t.Context()))
	require.NoError(t, dones[2].Err())
	require.Equal(t, client.StateCompleted, dones[2].Record().State)

	batches, calls := log.snapshot()
	require.Equal(t, [][]string{
		{"claim:m0"},
		{"complete:m0", "claim:m1"},
		{"complete:m1", "claim:m2"},
		{"complete:m2"},
	}, batches)
	require.Equal(t, map[string]int{"Batch": 4}, calls, "one RPC per message, and one for the last Complete")

	// Every outcome is durable: a redelivery replays it.
	for i := range 3 {
		res, d, err := cons.Handle(t.Context(), fmt.Sprintf("m%d", i), func(context.Context, client.Attempt) ([]byte, error) {
			t.Fatal("a completed message ran again")
			return nil, nil
		})
		require.ErrorIs(t, err, client.ErrConsumerClosed)
		_ = res
		_ = d
	}
	cons2 := c.Consumer("orders.pipelined")
	for i := range 3 {
		res, d, err := cons2.Handle(t.Context(), fmt.Sprintf("m%d", i), func(context.Context, client.Attempt) ([]byte, error) {
			t.Fatal("a completed message ran again")
			return nil, nil
		})
		require.NoError(t, err)
		require.True(t, res.Replayed)
		require.Equal(t, fmt.Sprintf("m%d", i), string(res.Data))
		require.NoError(t, d.Err())
	}
}

func chanOf(d *client.Done) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- d.Err() }()
	return ch
}

// A held Complete goes alone when no Claim comes within the linger, and at
// once when its Done is waited on.
func TestConsumerLingerAndWait(t *testing.T) {
	reg := inprocess.Start(t)
	c, log := loggedClient(t, reg.Addr)
	ok := func(context.Context, client.Attempt) ([]byte, error) { return nil, nil }

	lingering := c.Consumer("orders.linger", client.WithLinger(time.Millisecond))
	_, d, err := lingering.Handle(t.Context(), "a", ok)
	require.NoError(t, err)
	require.NoError(t, recv(t, chanOf(d)), "the linger sends the Complete alone")

	waiting := c.Consumer("orders.wait", client.WithLinger(time.Hour))
	_, d, err = waiting.Handle(t.Context(), "b", ok)
	require.NoError(t, err)
	rec, err := d.Wait(t.Context())
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, rec.State)

	batches, _ := log.snapshot()
	require.Equal(t, [][]string{{"claim:a"}, {"complete:a"}, {"claim:b"}, {"complete:b"}}, batches)
}

// A held Complete whose claim was taken over gets LEASE_LOST on its Done,
// and the Claim in the same Batch is answered as if it had gone alone.
func TestConsumerItemErrorsAreTheirOwn(t *testing.T) {
	clock := &inprocess.Clock{}
	reg := inprocess.Start(t, inprocess.WithClock(clock.Now))
	c, log := loggedClient(t, reg.Addr)
	cons := c.Consumer("orders.lost", client.WithLinger(time.Hour), client.WithLease(10*time.Second))

	_, stale, err := cons.Handle(t.Context(), "taken", func(ctx context.Context, a client.Attempt) ([]byte, error) {
		// The lease runs out and another holder takes the key over.
		clock.Advance(time.Minute)
		cl, err := reg.Client.Claim(ctx, client.ClaimParams{Key: a.Key})
		require.NoError(t, err)
		require.Equal(t, client.OutcomeAcquired, cl.Outcome)
		return []byte("late"), nil
	})
	require.NoError(t, err)

	res, next, err := cons.Handle(t.Context(), "next", func(context.Context, client.Attempt) ([]byte, error) { return []byte("ok"), nil })
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.ErrorIs(t, stale.Err(), client.ErrLeaseLost)
	require.NoError(t, cons.Flush(t.Context()))
	require.NoError(t, next.Err())

	batches, _ := log.snapshot()
	require.Equal(t, []string{"complete:taken", "claim:next"}, batches[1], "the stale Complete rode with the next Claim")
}

// A Claim the registry refuses does not fail the Complete it carried.
func TestConsumerRefusedClaimKeepsItsComplete(t *testing.T) {
	reg := inprocess.Start(t)
	c, log := loggedClient(t, reg.Addr)
	cons := c.Consumer("orders.refused", client.WithLinger(time.Hour))
	ok := func(context.Context, client.Attempt) ([]byte, error) { return []byte("ok"), nil }

	_, held, err := cons.Handle(t.Context(), "good", ok)
	require.NoError(t, err)
	_, refused, err := cons.Handle(t.Context(), "", ok) // no message id: INVALID_ARGUMENT
	require.ErrorIs(t, err, client.ErrInvalidArgument)
	require.ErrorIs(t, refused.Err(), client.ErrInvalidArgument)
	require.NoError(t, recv(t, chanOf(held)), "the carried Complete is stored")

	batches, _ := log.snapshot()
	require.Equal(t, []string{"complete:good", "claim:"}, batches[1])
}

// A Final error is stored (Done nil: ack), a retryable one releases the
// message at once (Done carries it: redeliver), as with Once.
func TestConsumerFailures(t *testing.T) {
	reg := inprocess.Start(t)
	c, _ := loggedClient(t, reg.Addr)
	cons := c.Consumer("orders.failures", client.WithLinger(time.Hour))
	defer func() { require.NoError(t, cons.Close(t.Context())) }()

	refused := status.Error(codes.FailedPrecondition, "card declined")
	_, d, err := cons.Handle(t.Context(), "final", func(context.Context, client.Attempt) ([]byte, error) {
		return nil, client.Final(refused)
	})
	require.True(t, client.IsFinal(err))
	_, err = d.Wait(t.Context())
	require.NoError(t, err, "the final failure is durable: ack")

	boom := errors.New("downstream down")
	_, d, err = cons.Handle(t.Context(), "retry", func(context.Context, client.Attempt) ([]byte, error) { return nil, boom })
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, d.Err(), boom, "a retryable error resolves Done at once: nak")

	// The released message runs again; the final one replays its failure.
	res, d, err := cons.Handle(t.Context(), "retry", func(_ context.Context, a client.Attempt) ([]byte, error) {
		require.Equal(t, int64(2), a.Attempt)
		return nil, nil
	})
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.NoError(t, cons.Flush(t.Context()))
	require.NoError(t, d.Err())
	res, d, err = cons.Handle(t.Context(), "final", func(context.Context, client.Attempt) ([]byte, error) {
		t.Fatal("a final failure ran again")
		return nil, nil
	})
	require.True(t, res.Replayed)
	require.True(t, client.IsFinal(err))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.NoError(t, d.Err())
}

// Workers of one consumer share its held Completes: every message runs
// once, every Done resolves, and every outcome is stored.
func TestConsumerWorkersRace(t *testing.T) {
	reg := inprocess.Start(t)
	c, log := loggedClient(t, reg.Addr)
	cons := c.Consumer("orders.workers")
	const workers, perWorker = 8, 40
	var ran sync.Map
	var runs atomic.Int64
	var wg sync.WaitGroup
	dones := make(chan *client.Done, workers*perWorker)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				id := fmt.Sprintf("w%d-m%d", w, i)
				_, d, err := cons.Handle(t.Context(), id, func(_ context.Context, a client.Attempt) ([]byte, error) {
					if _, dup := ran.LoadOrStore(a.Key.Key, true); dup {
						t.Errorf("%s ran twice", a.Key.Key)
					}
					runs.Add(1)
					return []byte(a.Key.Key), nil
				})
				if err != nil {
					t.Error(err)
					return
				}
				dones <- d
			}
		}()
	}
	wg.Wait()
	require.NoError(t, cons.Close(t.Context()))
	close(dones)
	for d := range dones {
		require.NoError(t, d.Err())
		require.Equal(t, client.StateCompleted, d.Record().State)
	}
	require.Equal(t, int64(workers*perWorker), runs.Load())
	_, calls := log.snapshot()
	require.Equal(t, 0, calls["Complete"]+calls["BatchComplete"]+calls["Claim"], "every call a Batch: %v", calls)
	for w := range workers {
		rec, err := c.Lookup(t.Context(), client.Key{Consumer: "orders.workers", Kind: client.KindMessage, Key: fmt.Sprintf("w%d-m%d", w, perWorker-1)})
		require.NoError(t, err)
		require.Equal(t, client.StateCompleted, rec.State)
	}
}

// A registry without Batch (one that predates it answers UNIMPLEMENTED,
// here the connection's interceptor in its place, before the call leaves)
// is remembered after one try: the Consumer then makes Once's calls, and
// every message is still handled once and completed.
func TestConsumerRegistryWithoutBatch(t *testing.T) {
	reg := inprocess.Start(t)
	l := &batchLog{calls: map[string]int{}}
	conn, err := grpc.NewClient(reg.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(l.interceptor,
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				if method == "/idemreg.v1.RegistryService/Batch" {
					return status.Error(codes.Unimplemented, "unknown method Batch")
				}
				return invoker(ctx, method, req, reply, cc, opts...)
			}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	c := client.New(conn)
	cons := c.Consumer("orders.old-registry", client.WithLinger(time.Hour))

	var dones []*client.Done
	for i := range 4 {
		res, d, err := cons.Handle(t.Context(), fmt.Sprintf("m%d", i), func(context.Context, client.Attempt) ([]byte, error) { return []byte("ok"), nil })
		require.NoError(t, err)
		require.True(t, res.Ran)
		dones = append(dones, d)
	}
	require.NoError(t, cons.Close(t.Context()))
	for _, d := range dones {
		require.NoError(t, d.Err())
		require.Equal(t, client.StateCompleted, d.Record().State)
	}
	_, calls := l.snapshot()
	require.Equal(t, 1, calls["Batch"], "Batch tried once: %v", calls)
	require.Equal(t, 4, calls["Claim"], "%v", calls)
	require.Equal(t, 4, calls["Complete"]+calls["BatchComplete"], "%v", calls)
}

// A held Complete whose Batch finds the registry down is repeated until
// the registry is back (within its bookkeeping timeout), and the Claim
// that carried it fails on its own, without waiting for those repeats.
func TestConsumerCompleteOutlivesAnOutage(t *testing.T) {
	reg := inprocess.Start(t)
	var down atomic.Bool
	conn, err := grpc.NewClient(reg.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if down.Load() {
				return status.Error(codes.Unavailable, "connection refused")
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	cons := client.New(conn).Consumer("orders.outage", client.WithLinger(time.Hour), client.WithBookkeepingTimeout(time.Minute))

	_, held, err := cons.Handle(t.Context(), "a", func(context.Context, client.Attempt) ([]byte, error) { return []byte("a"), nil })
	require.NoError(t, err)
	down.Store(true)
	ctx, cancel := context.WithTimeout(t.Context(), hangGuard)
	defer cancel()
	_, d, err := cons.Handle(ctx, "b", func(context.Context, client.Attempt) ([]byte, error) {
		t.Fatal("ran without a claim")
		return nil, nil
	})
	require.ErrorIs(t, err, client.ErrUnavailable)
	require.ErrorIs(t, d.Err(), client.ErrUnavailable)
	select {
	case <-held.Ready():
		t.Fatal("the carried Complete resolved while the registry was down")
	default:
	}
	down.Store(false)
	require.NoError(t, recv(t, chanOf(held)))
	require.Equal(t, "a", string(held.Record().Result.Response.Data))
}

// With its one Batch in flight, the Consumer queues a worker's Claim: a
// worker that gives up while queued returns at once and its Claim is never
// sent, and the others' Claims are answered once the Batch is.
func TestConsumerQueuedClaims(t *testing.T) {
	reg := inprocess.Start(t)
	l := &batchLog{calls: map[string]int{}}
	gate, sent := make(chan struct{}), make(chan struct{}, 10)
	var gated atomic.Bool
	gated.Store(true)
	conn, err := grpc.NewClient(reg.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(l.interceptor,
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				if gated.CompareAndSwap(true, false) {
					sent <- struct{}{}
					<-gate // the first Batch's answer is held back
				}
				return err
			}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	cons := client.New(conn).Consumer("orders.queued", client.WithConsumerInFlight(1), client.WithLinger(time.Hour))
	ok := func(context.Context, client.Attempt) ([]byte, error) { return nil, nil }

	first := make(chan error, 1)
	go func() { _, _, err := cons.Handle(t.Context(), "first", ok); first <- err }()
	recv(t, sent)

	ctx, cancel := context.WithCancel(t.Context())
	gaveUp := make(chan error, 1)
	go func() { _, _, err := cons.Handle(ctx, "abandoned", ok); gaveUp <- err }()
	queued := make(chan error, 2)
	for _, id := range []string{"q1", "q2"} {
		go func() { _, _, err := cons.Handle(t.Context(), id, ok); queued <- err }()
	}
	cancel()
	require.ErrorIs(t, recv(t, gaveUp), client.ErrCanceled, "a queued Claim's caller leaves at once")

	close(gate)
	require.NoError(t, recv(t, first))
	require.NoError(t, recv(t, queued))
	require.NoError(t, recv(t, queued))
	require.NoError(t, cons.Close(t.Context()))

	batches, _ := l.snapshot()
	var claims []string
	for _, b := range batches {
		for _, it := range b {
			if it == "claim:abandoned" {
				t.Fatalf("the abandoned Claim was sent: %v", batches)
			}
		}
		claims = append(claims, fmt.Sprint(b))
	}
	// Claims that queued in time share the next Batch; how many did is the
	// scheduler's, so it is logged, not asserted.
	t.Log("Batches:", claims)
}
