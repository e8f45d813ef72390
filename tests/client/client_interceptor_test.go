package client_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// callerEnv is a caller whose connection to a real downstream goes through
// UnaryClientInterceptor backed by a real registry.
type callerEnv struct {
	reg  *inprocess.Registry
	down *downstream
	conn *grpc.ClientConn
	obs  *observer
}

func newCaller(t *testing.T, regOpts []inprocess.Option, opts ...client.InterceptorOption) *callerEnv {
	t.Helper()
	reg := inprocess.Start(t, regOpts...)
	c, obs := observedClient(t, reg)
	addr, down := startDownstream(t)
	conn := dial(t, addr, grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(c, opts...)))
	return &callerEnv{reg: reg, down: down, conn: conn, obs: obs}
}

func callKey(key string) client.Key {
	return client.Key{Consumer: "call:" + downstreamService + "/Charge", Kind: client.KindOperation, Key: key}
}

func TestClientInterceptorAcquiredAndReplayed(t *testing.T) {
	e := newCaller(t, nil)
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")

	var replayed bool
	var header metadata.MD
	out, err := charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed), grpc.Header(&header))
	require.NoError(t, err)
	require.Equal(t, "charged:10 EUR", out.GetValue())
	require.False(t, replayed)
	require.Empty(t, header.Get(client.ReplayedHeader))
	require.EqualValues(t, 1, e.down.calls.Load())
	require.Equal(t, []string{"payment:op-1"}, e.down.seenKeys(), "the key is forwarded to the downstream")

	rec, err := e.reg.Client.Lookup(t.Context(), callKey("payment:op-1"))
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, rec.State)
	require.Equal(t, "google.protobuf.StringValue", rec.Result.Response.Type)
	want, err := client.DefaultFingerprint(chargeMethod, wrapperspb.String("10 EUR"))
	require.NoError(t, err)
	require.Equal(t, want, rec.Fingerprint)

	for range 2 {
		replayed, header = false, nil
		out, err = charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed), grpc.Header(&header))
		require.NoError(t, err)
		require.Equal(t, "charged:10 EUR", out.GetValue())
		require.True(t, replayed)
		require.Equal(t, []string{"true"}, header.Get(client.ReplayedHeader))
	}
	require.EqualValues(t, 1, e.down.calls.Load(), "replays do not call the downstream")

	// Another key is another operation.
	_, err = charge(client.WithIdempotencyKey(t.Context(), "payment:op-2"), e.conn, "10 EUR")
	require.NoError(t, err)
	require.EqualValues(t, 2, e.down.calls.Load())
}

func TestClientInterceptorReplaysStoredFailure(t *testing.T) {
	e := newCaller(t, nil)
	e.down.setRespond(func(context.Context, int64, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		st, _ := status.New(codes.FailedPrecondition, "card declined").
			WithDetails(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
		return nil, st.Err()
	})
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
	_, first := charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.FailedPrecondition, status.Code(first))

	var replayed bool
	_, again := charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed))
	require.True(t, replayed)
	require.EqualValues(t, 1, e.down.calls.Load())
	require.True(t, proto.Equal(status.Convert(first).Proto(), status.Convert(again).Proto()),
		"the replay is the same status, details included: %v vs %v", first, again)
	require.Equal(t, "CARD_DECLINED", status.Convert(again).Details()[0].(*errdetails.ErrorInfo).GetReason())
}

func TestClientInterceptorReleasesOnRetryableErrors(t *testing.T) {
	for _, code := range []codes.Code{codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Canceled} {
		t.Run(code.String(), func(t *testing.T) {
			e := newCaller(t, nil)
			e.down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
				if n == 1 {
					return nil, status.Error(code, "try again")
				}
				return wrapperspb.String("charged:" + req.GetValue()), nil
			})
			ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
			_, err := charge(ctx, e.conn, "10 EUR")
			require.Equal(t, code, status.Code(err))
			out, err := charge(ctx, e.conn, "10 EUR")
			require.NoError(t, err, "the key was released, so the retry calls the downstream")
			require.Equal(t, "charged:10 EUR", out.GetValue())
			require.EqualValues(t, 2, e.down.calls.Load())
			rec, err := e.reg.Client.Lookup(t.Context(), callKey("payment:op-1"))
			require.NoError(t, err)
			require.EqualValues(t, 2, rec.Attempt)
		})
	}

	t.Run("replaced classifier", func(t *testing.T) {
		e := newCaller(t, nil, client.WithRetryable(func(error) bool { return false }))
		e.down.setRespond(func(context.Context, int64, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			return nil, status.Error(codes.Unavailable, "provider down")
		})
		ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
		_, err := charge(ctx, e.conn, "10 EUR")
		require.Equal(t, codes.Unavailable, status.Code(err))
		var replayed bool
		_, err = charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed))
		require.Equal(t, codes.Unavailable, status.Code(err))
		require.True(t, replayed, "classified final: stored and replayed")
		require.EqualValues(t, 1, e.down.calls.Load())
	})
}

func TestClientInterceptorInProgress(t *testing.T) {
	e := newCaller(t, nil, client.WithInProgressWait(0))
	entered, release := make(chan struct{}), make(chan struct{})
	e.down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if n == 1 {
			close(entered)
			<-release
		}
		return wrapperspb.String("charged:" + req.GetValue()), nil
	})
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
	first := make(chan error, 1)
	go func() { _, err := charge(ctx, e.conn, "10 EUR"); first <- err }()
	recv(t, entered)

	_, err := charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.Aborted, status.Code(err))
	require.ErrorIs(t, err, client.ErrInProgress)
	var ie *client.InProgressError
	require.ErrorAs(t, err, &ie)
	require.Positive(t, ie.RetryAfter)
	var retry *errdetails.RetryInfo
	for _, d := range status.Convert(err).Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			retry = r
		}
	}
	require.NotNil(t, retry, "ABORTED carries a RetryInfo")
	require.Equal(t, ie.RetryAfter, retry.GetRetryDelay().AsDuration())

	close(release)
	require.NoError(t, recv(t, first))
	require.EqualValues(t, 1, e.down.calls.Load())
}

func TestClientInterceptorWaitsInProgress(t *testing.T) {
	e := newCaller(t, nil, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond}))
	entered, release := make(chan struct{}), make(chan struct{})
	e.down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if n == 1 {
			close(entered)
			<-release
		}
		return wrapperspb.String("charged:" + req.GetValue()), nil
	})
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
	first := make(chan error, 1)
	go func() { _, err := charge(ctx, e.conn, "10 EUR"); first <- err }()
	recv(t, entered)

	second := make(chan error, 1)
	var replayed bool
	go func() {
		out, err := charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed))
		if err == nil && out.GetValue() != "charged:10 EUR" {
			err = fmt.Errorf("got %q", out.GetValue())
		}
		second <- err
	}()
	e.obs.waitSent(t, "Claim", 3) // the duplicate's second Claim waits
	close(release)
	require.NoError(t, recv(t, first))
	require.NoError(t, recv(t, second))
	require.True(t, replayed)
	require.Equal(t, 1, e.obs.inProgressAnswers(), "the registry waited: the duplicate's first Claim, which asks for no wait so that it can share an RPC, is the one IN_PROGRESS answer; no polling")
	require.EqualValues(t, 1, e.down.calls.Load())

	t.Run("until the deadline", func(t *testing.T) {
		entered, release := make(chan struct{}), make(chan struct{})
		e.down.setRespond(func(context.Context, int64, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			close(entered)
			<-release
			return wrapperspb.String("late"), nil
		})
		defer close(release)
		key := client.WithIdempotencyKey(t.Context(), "payment:op-2")
		go func() { _, _ = charge(key, e.conn, "10 EUR") }()
		recv(t, entered)
		ctx, cancel := context.WithTimeout(key, 50*time.Millisecond)
		defer cancel()
		_, err := charge(ctx, e.conn, "10 EUR")
		require.Equal(t, codes.DeadlineExceeded, status.Code(err))
	})
}

func TestClientInterceptorFingerprintMismatch(t *testing.T) {
	e := newCaller(t, nil)
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
	_, err := charge(ctx, e.conn, "10 EUR")
	require.NoError(t, err)
	_, err = charge(ctx, e.conn, "99 EUR")
	require.ErrorIs(t, err, client.ErrFingerprintMismatch)
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.EqualValues(t, 1, e.down.calls.Load())

	t.Run("replaced fingerprint", func(t *testing.T) {
		// Fingerprint only the currency: the amount may differ between retries.
		e := newCaller(t, nil, client.WithFingerprint(func(method string, req proto.Message) ([]byte, error) {
			v := req.(*wrapperspb.StringValue).GetValue()
			return client.DefaultFingerprint(method, wrapperspb.String(v[len(v)-3:]))
		}))
		_, err := charge(ctx, e.conn, "10 EUR")
		require.NoError(t, err)
		out, err := charge(ctx, e.conn, "11 EUR")
		require.NoError(t, err)
		require.Equal(t, "charged:10 EUR", out.GetValue())
		_, err = charge(ctx, e.conn, "10 USD")
		require.ErrorIs(t, err, client.ErrFingerprintMismatch)
	})
}

func TestClientInterceptorRegistryDown(t *testing.T) {
	t.Run("fails closed by default", func(t *testing.T) {
		e := newCaller(t, nil)
		require.NoError(t, e.reg.Stop())
		_, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		require.Equal(t, codes.Unavailable, status.Code(err))
		var ue *client.UnavailableError
		require.ErrorAs(t, err, &ue, "the caller can tell the registry, not the downstream, was unavailable")
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("store down fails closed with a retry delay", func(t *testing.T) {
		e := newCaller(t, nil)
		require.NoError(t, e.reg.StopStore())
		_, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		var ue *client.UnavailableError
		require.ErrorAs(t, err, &ue)
		require.Equal(t, time.Second, ue.RetryAfter)
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("fail open calls the downstream with the key", func(t *testing.T) {
		e := newCaller(t, nil, client.WithRegistryUnavailable(client.FailOpen))
		require.NoError(t, e.reg.Stop())
		out, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		require.NoError(t, err)
		require.Equal(t, "charged:10 EUR", out.GetValue())
		require.Equal(t, []string{"payment:op-1"}, e.down.seenKeys())
	})
	t.Run("registry gone before completion: the reply still reaches the caller", func(t *testing.T) {
		e := newCaller(t, nil, client.WithBookkeepingTimeout(50*time.Millisecond))
		e.down.setRespond(func(_ context.Context, _ int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			assert.NoError(t, e.reg.StopStore())
			return wrapperspb.String("charged:" + req.GetValue()), nil
		})
		out, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		require.NoError(t, err)
		require.Equal(t, "charged:10 EUR", out.GetValue())
	})
}

func TestClientInterceptorKeys(t *testing.T) {
	t.Run("missing key is refused by default", func(t *testing.T) {
		e := newCaller(t, nil)
		_, err := charge(t.Context(), e.conn, "10 EUR")
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.ErrorIs(t, err, client.ErrMissingKey)
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("missing key passes through when configured", func(t *testing.T) {
		e := newCaller(t, nil, client.WithMissingKey(client.MissingKeyPassThrough))
		_, err := charge(t.Context(), e.conn, "10 EUR")
		require.NoError(t, err)
		_, err = charge(t.Context(), e.conn, "10 EUR")
		require.NoError(t, err)
		require.EqualValues(t, 2, e.down.calls.Load())
		require.Empty(t, e.down.seenKeys())
	})
	t.Run("key from the outgoing metadata", func(t *testing.T) {
		e := newCaller(t, nil)
		ctx := metadata.AppendToOutgoingContext(t.Context(), client.KeyMetadata, "payment:md")
		_, err := charge(ctx, e.conn, "10 EUR")
		require.NoError(t, err)
		var replayed bool
		_, err = charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, []string{"payment:md"}, e.down.seenKeys())
	})
	t.Run("the context key wins over the metadata", func(t *testing.T) {
		e := newCaller(t, nil)
		ctx := metadata.AppendToOutgoingContext(t.Context(), client.KeyMetadata, "payment:md")
		_, err := charge(client.WithIdempotencyKey(ctx, "payment:ctx"), e.conn, "10 EUR")
		require.NoError(t, err)
		require.Equal(t, []string{"payment:ctx"}, e.down.seenKeys(), "exactly one key reaches the downstream")
		_, err = e.reg.Client.Lookup(t.Context(), callKey("payment:ctx"))
		require.NoError(t, err)
	})
	t.Run("unselected methods pass through", func(t *testing.T) {
		e := newCaller(t, nil, client.WithMethods(refundMethod))
		_, err := charge(t.Context(), e.conn, "10 EUR")
		require.NoError(t, err, "Charge is not selected: no key needed")
		err = e.conn.Invoke(t.Context(), refundMethod, wrapperspb.String("x"), new(wrapperspb.StringValue))
		require.ErrorIs(t, err, client.ErrMissingKey)
	})
	t.Run("consumer option", func(t *testing.T) {
		e := newCaller(t, nil, client.WithConsumer("checkout.charges"))
		_, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		require.NoError(t, err)
		_, err = e.reg.Client.Lookup(t.Context(), client.Key{Consumer: "checkout.charges", Kind: client.KindOperation, Key: "payment:op-1"})
		require.NoError(t, err)
	})
	t.Run("the downstream's metadata never reaches the registry", func(t *testing.T) {
		e := newCaller(t, nil)
		ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer provider-secret")
		_, err := charge(client.WithIdempotencyKey(ctx, "payment:op-1"), e.conn, "10 EUR")
		require.NoError(t, err)
		for _, md := range e.obs.allMetadata() {
			require.Empty(t, md.Get("authorization"))
		}
		require.NotEmpty(t, e.obs.allMetadata())
	})
}

func TestClientInterceptorHoldsLongCalls(t *testing.T) {
	e := newCaller(t, []inprocess.Option{shortLeases()}, client.WithLease(60*time.Millisecond))
	key := callKey("payment:op-1")
	entered, proceed := make(chan struct{}), make(chan struct{})
	e.down.setRespond(func(_ context.Context, _ int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		close(entered)
		<-proceed // a slow provider: the call outlives several leases
		return wrapperspb.String("charged:" + req.GetValue()), nil
	})
	done := make(chan error, 1)
	go func() {
		_, err := charge(client.WithIdempotencyKey(t.Context(), "payment:op-1"), e.conn, "10 EUR")
		done <- err
	}()
	recv(t, entered)
	first, err := e.reg.Client.Lookup(t.Context(), key)
	require.NoError(t, err)
	eventually(t, func() bool {
		rec, err := e.reg.Client.Lookup(t.Context(), key)
		require.NoError(t, err)
		return rec.LeaseExpiresAt.After(first.LeaseExpiresAt.Add(100 * time.Millisecond))
	}, "the lease to be extended past 100ms")
	close(proceed)
	require.NoError(t, recv(t, done))

	rec, err := e.reg.Client.Lookup(t.Context(), key)
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, rec.State)
	require.EqualValues(t, 1, rec.Attempt, "nobody took the key over while the call ran")
}

func TestClientInterceptorPassesStreamsThrough(t *testing.T) {
	e := newCaller(t, nil) // refuses keyless unary calls
	got, err := watch(t.Context(), e.conn, "s")
	require.NoError(t, err)
	require.Equal(t, []string{"s0", "s1", "s2"}, got)
	require.Empty(t, e.obs.allMetadata(), "a stream never reaches the registry")
}

// TestClientInterceptorRace: 32 callers retry one payment at once. The
// provider is called once; every caller gets the same answer.
func TestClientInterceptorRace(t *testing.T) {
	e := newCaller(t, nil, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond}))
	const n = 32
	var wg sync.WaitGroup
	var replays atomic.Int64
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			var replayed bool
			out, err := charge(client.WithIdempotencyKey(t.Context(), "payment:race"), e.conn, "10 EUR", client.Replayed(&replayed))
			if assert.NoError(t, err) {
				assert.Equal(t, "charged:10 EUR", out.GetValue())
			}
			if replayed {
				replays.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, e.down.calls.Load())
	require.EqualValues(t, n-1, replays.Load())
}

// TestClientInterceptorDeadlineDuringClaim: a call whose deadline hits
// while its Claim is in flight does not leave the key claimed for a lease.
func TestClientInterceptorDeadlineDuringClaim(t *testing.T) {
	reg := inprocess.Start(t)
	c, sent, open := gatedClient(t, reg)
	defer open()
	time.AfterFunc(hangGuard, open) // see TestOnceDeadlineDuringClaim
	addr, down := startDownstream(t)
	conn := dial(t, addr, grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(c, client.WithLease(time.Hour))))
	key := client.WithIdempotencyKey(t.Context(), "payment:op-1")

	ctx, cancel := context.WithCancel(key)
	go func() { <-sent; cancel() }()
	_, err := charge(ctx, conn, "10 EUR")
	require.Equal(t, codes.Canceled, status.Code(err))
	require.Zero(t, down.calls.Load())

	open()
	eventually(t, func() bool {
		_, err := charge(key, conn, "10 EUR")
		return err == nil
	}, "the retry to get through")
	require.EqualValues(t, 1, down.calls.Load())
}

func TestDefaultFingerprint(t *testing.T) {
	a, err := client.DefaultFingerprint("/s/M", wrapperspb.String("x"))
	require.NoError(t, err)
	require.Len(t, a, 32)
	again, err := client.DefaultFingerprint("/s/M", wrapperspb.String("x"))
	require.NoError(t, err)
	require.Equal(t, a, again)
	other, err := client.DefaultFingerprint("/s/N", wrapperspb.String("x"))
	require.NoError(t, err)
	require.NotEqual(t, a, other, "the method is part of the fingerprint")
	body, err := client.DefaultFingerprint("/s/M", wrapperspb.String("y"))
	require.NoError(t, err)
	require.NotEqual(t, a, body)
	// A method name that ends like the start of an encoded body does not
	// collide with a shorter name and a longer body.
	enc, err := proto.Marshal(wrapperspb.String("x"))
	require.NoError(t, err)
	shifted, err := client.DefaultFingerprint("/s/M\x00"+string(enc[:1]), &wrapperspb.StringValue{})
	require.NoError(t, err)
	require.NotEqual(t, a, shifted)
}
