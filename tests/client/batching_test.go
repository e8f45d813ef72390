package client_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// heldConn is a connection to reg whose first RPC is held (after the
// registry answered it) until release is closed, and that records every
// RPC's method and items.
type heldConn struct {
	first   chan struct{} // closed when the first RPC is held
	release chan struct{}
	once    sync.Once
	obs     *observer
}

func newHeldConn(t *testing.T, reg *inprocess.Registry) (*grpc.ClientConn, *heldConn) {
	t.Helper()
	h := &heldConn{first: make(chan struct{}), release: make(chan struct{}), obs: newObserver()}
	conn, err := grpc.NewClient(reg.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			h.obs.record(method, req)
			err := invoker(ctx, method, req, reply, cc, opts...)
			held := false
			h.once.Do(func() { held = true })
			if held {
				close(h.first)
				<-h.release
			}
			return err
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn, h
}

// TestBatchingSharesRPCs: calls that arrive while the client's RPCs are in
// flight go out together, each answered as its own call would have been;
// a lone call is a plain unary RPC.
func TestBatchingSharesRPCs(t *testing.T) {
	reg := inprocess.Start(t)
	conn, h := newHeldConn(t, reg)
	c := client.New(conn, client.WithBatching(client.Batching{MaxInFlight: 1}))
	key := func(k string) client.Key { return client.Key{Consumer: inbox, Kind: client.KindMessage, Key: k} }

	// A lone Claim goes out as Claim, and is held in flight.
	firstDone := make(chan error, 1)
	go func() {
		_, err := c.Claim(t.Context(), client.ClaimParams{Key: key("first")})
		firstDone <- err
	}()
	recv(t, h.first)

	const n = 16
	var wg sync.WaitGroup
	claims := make([]client.Claim, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { claims[i], errs[i] = c.Claim(t.Context(), client.ClaimParams{Key: key(string(rune('a' + i)))}) })
	}
	// All sixteen queue behind the held RPC.
	eventually(t, func() bool { return h.obs.sentCount("Batch") == 0 && h.obs.sentCount("Claim") == 1 }, "the first Claim held")
	time.Sleep(50 * time.Millisecond) // let the callers queue; the assertions below do not depend on it
	close(h.release)
	require.NoError(t, recv(t, firstDone))
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, client.OutcomeAcquired, claims[i].Outcome)
		require.Equal(t, string(rune('a'+i)), claims[i].Record.Key.Key, "each caller gets its own answer")
	}
	require.Less(t, h.obs.sentCount("Batch")+h.obs.sentCount("Claim"), 1+n, "calls shared RPCs")
	require.Positive(t, h.obs.sentCount("Batch"))

	// Completes share RPCs too; sequential calls stay unary.
	var cw sync.WaitGroup
	for i := range n {
		cw.Go(func() {
			_, err := c.Complete(t.Context(), key(string(rune('a'+i))), claims[i].Fence(), client.ResponseResult("t", []byte{byte(i)}))
			assert.NoError(t, err)
		})
	}
	cw.Wait()
	for i := range n {
		rec, err := c.Lookup(t.Context(), key(string(rune('a'+i))))
		require.NoError(t, err)
		require.Equal(t, []byte{byte(i)}, rec.Result.Response.Data, "each Complete stored its own result")
	}
	before := h.obs.sentCount("Batch")
	for i := range 3 {
		_, err := c.Claim(t.Context(), client.ClaimParams{Key: key("seq" + string(rune('0'+i)))})
		require.NoError(t, err)
	}
	require.Equal(t, before, h.obs.sentCount("Batch"), "a lone call is never batched")
}

// TestBatchingIsolatesCallers: one caller's cancellation, deadline or bad
// input never fails another's item in the same RPC.
func TestBatchingIsolatesCallers(t *testing.T) {
	reg := inprocess.Start(t)
	conn, h := newHeldConn(t, reg)
	c := client.New(conn, client.WithBatching(client.Batching{MaxInFlight: 1}))
	key := func(k string) client.Key { return client.Key{Consumer: inbox, Kind: client.KindMessage, Key: k} }
	go func() { _, _ = c.Claim(t.Context(), client.ClaimParams{Key: key("first")}) }()
	recv(t, h.first)

	type answer struct {
		cl  client.Claim
		err error
	}
	start := func(ctx context.Context, p client.ClaimParams) chan answer {
		ch := make(chan answer, 1)
		go func() { cl, err := c.Claim(ctx, p); ch <- answer{cl, err} }()
		return ch
	}
	good := start(t.Context(), client.ClaimParams{Key: key("good")})
	cancelled, cancel := context.WithCancel(t.Context())
	gone := start(cancelled, client.ClaimParams{Key: key("cancelled")})
	short, cancelShort := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancelShort()
	late := start(short, client.ClaimParams{Key: key("deadline")})
	tooLong := start(t.Context(), client.ClaimParams{Key: key(string(make([]byte, 300)))})
	notUTF8 := start(t.Context(), client.ClaimParams{Key: key("bad\xff")})
	good2 := start(t.Context(), client.ClaimParams{Key: key("good2")})
	time.Sleep(50 * time.Millisecond)
	cancel()

	a := recv(t, gone)
	require.ErrorIs(t, a.err, context.Canceled, "the cancelled caller returns at once")
	a = recv(t, late)
	require.ErrorIs(t, a.err, context.DeadlineExceeded, "the caller's own deadline holds")
	a = recv(t, notUTF8)
	require.Error(t, a.err, "bytes that do not encode fail their own call")
	close(h.release)
	for _, ch := range []chan answer{good, good2} {
		a := recv(t, ch)
		require.NoError(t, a.err)
		require.Equal(t, client.OutcomeAcquired, a.cl.Outcome)
	}
	a = recv(t, tooLong)
	require.ErrorIs(t, a.err, client.ErrInvalidArgument)
	require.Equal(t, codes.InvalidArgument, status.Code(a.err))
	_, err := c.Lookup(t.Context(), key("cancelled"))
	require.ErrorIs(t, err, client.ErrNotFound, "a caller that gave up before its call was sent claims nothing")
}

// TestWithoutBatching: every call its own RPC.
func TestWithoutBatching(t *testing.T) {
	reg := inprocess.Start(t)
	conn, h := newHeldConn(t, reg)
	close(h.release)
	c := client.New(conn, client.WithoutBatching())
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			_, err := c.Claim(t.Context(), client.ClaimParams{Key: client.Key{Consumer: inbox, Kind: client.KindMessage, Key: fmt.Sprint("k", i)}})
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	require.Zero(t, h.obs.sentCount("Batch")+h.obs.sentCount("BatchClaim"))
	require.Equal(t, 32, h.obs.sentCount("Claim"))
}
