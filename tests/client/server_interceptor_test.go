package client_test

import (
	"context"
	"fmt"
	"strings"
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
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// serviceEnv is a service whose RPCs go through UnaryServerInterceptor,
// called over a plain connection.
type serviceEnv struct {
	reg  *inprocess.Registry
	down *downstream
	conn *grpc.ClientConn
	obs  *observer
}

// recoverPanics turns a handler panic into INTERNAL, as a service's
// recovery middleware would, outside the idempotency interceptor.
func recoverPanics(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = status.Errorf(codes.Internal, "panic: %v", p)
		}
	}()
	return next(ctx, req)
}

func newService(t *testing.T, opts ...client.InterceptorOption) *serviceEnv {
	t.Helper()
	reg := inprocess.Start(t)
	c, obs := observedClient(t, reg)
	addr, down := startDownstream(t, grpc.ChainUnaryInterceptor(recoverPanics, client.UnaryServerInterceptor(c, opts...)),
		grpc.ChainStreamInterceptor())
	return &serviceEnv{reg: reg, down: down, conn: dial(t, addr), obs: obs}
}

func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, client.KeyMetadata, key)
}

func errorInfo(t *testing.T, err error) *errdetails.ErrorInfo {
	t.Helper()
	for _, d := range status.Convert(err).Details() {
		if i, ok := d.(*errdetails.ErrorInfo); ok {
			return i
		}
	}
	t.Fatalf("no ErrorInfo in %v", err)
	return nil
}

func retryInfo(t *testing.T, err error) time.Duration {
	t.Helper()
	for _, d := range status.Convert(err).Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			return r.GetRetryDelay().AsDuration()
		}
	}
	t.Fatalf("no RetryInfo in %v", err)
	return 0
}

func TestServerInterceptorAcquiredAndReplayed(t *testing.T) {
	e := newService(t)
	ctx := withKey(t.Context(), "order-42/charge")

	var header metadata.MD
	out, err := charge(ctx, e.conn, "10 EUR", grpc.Header(&header))
	require.NoError(t, err)
	require.Equal(t, "charged:10 EUR", out.GetValue())
	require.Empty(t, header.Get(client.ReplayedHeader))

	rec, err := e.reg.Client.Lookup(t.Context(), client.Key{Consumer: "rpc:" + downstreamService + "/Charge", Kind: client.KindOperation, Key: "order-42/charge"})
	require.NoError(t, err, "the consumer is derived from the service and method")
	require.Equal(t, client.StateCompleted, rec.State)

	for range 2 {
		header = nil
		out, err = charge(ctx, e.conn, "10 EUR", grpc.Header(&header))
		require.NoError(t, err)
		require.Equal(t, "charged:10 EUR", out.GetValue())
		require.Equal(t, []string{"true"}, header.Get(client.ReplayedHeader))
	}
	require.EqualValues(t, 1, e.down.calls.Load())
}

func TestServerInterceptorReplaysStoredFailure(t *testing.T) {
	e := newService(t)
	e.down.setRespond(func(context.Context, int64, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	})
	ctx := withKey(t.Context(), "order-42/charge")
	_, err := charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	var header metadata.MD
	_, err = charge(ctx, e.conn, "10 EUR", grpc.Header(&header))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, "card declined", status.Convert(err).Message())
	require.Equal(t, []string{"true"}, header.Get(client.ReplayedHeader))
	require.EqualValues(t, 1, e.down.calls.Load())
}

func TestServerInterceptorReleasesOnRetryableErrors(t *testing.T) {
	e := newService(t)
	e.down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		switch n {
		case 1:
			return nil, status.Error(codes.Unavailable, "ledger busy")
		case 2:
			panic("handler bug")
		}
		return wrapperspb.String("charged:" + req.GetValue()), nil
	})
	ctx := withKey(t.Context(), "order-42/charge")
	_, err := charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.Unavailable, status.Code(err))
	_, err = charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.Internal, status.Code(err), "the panic reached the recovery middleware")
	out, err := charge(ctx, e.conn, "10 EUR")
	require.NoError(t, err, "neither the retryable error nor the panic kept the key")
	require.Equal(t, "charged:10 EUR", out.GetValue())
	require.EqualValues(t, 3, e.down.calls.Load())
}

func TestServerInterceptorInProgress(t *testing.T) {
	for _, wait := range []bool{false, true} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			opts := []client.InterceptorOption{client.WithInProgressWait(0)}
			if wait {
				opts = []client.InterceptorOption{client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond})}
			}
			e := newService(t, opts...)
			entered, release := make(chan struct{}), make(chan struct{})
			e.down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
				if n == 1 {
					close(entered)
					<-release
				}
				return wrapperspb.String("charged:" + req.GetValue()), nil
			})
			ctx := withKey(t.Context(), "order-42/charge")
			first := make(chan error, 1)
			go func() { _, err := charge(ctx, e.conn, "10 EUR"); first <- err }()
			recv(t, entered)

			if !wait {
				_, err := charge(ctx, e.conn, "10 EUR")
				require.Equal(t, codes.Aborted, status.Code(err))
				require.Equal(t, client.ReasonInProgress, errorInfo(t, err).GetReason())
				require.Positive(t, retryInfo(t, err))
				require.ErrorIs(t, client.FromError(err), client.ErrInProgress, "callers type it with FromError")
				close(release)
				require.NoError(t, recv(t, first))
			} else {
				second := make(chan error, 1)
				var header metadata.MD
				go func() { _, err := charge(ctx, e.conn, "10 EUR", grpc.Header(&header)); second <- err }()
				// The duplicate's Claim is on its way: the registry holds it
				// until the first request's response is stored.
				e.obs.waitSent(t, "Claim", 3)
				close(release)
				require.NoError(t, recv(t, first))
				require.NoError(t, recv(t, second), "the duplicate gets the first response, not ABORTED")
				require.Equal(t, []string{"true"}, header.Get(client.ReplayedHeader))
				require.Equal(t, 1, e.obs.inProgressAnswers(), "the registry waited: the duplicate's first Claim, which asks for no wait so that it can share an RPC, is the one IN_PROGRESS answer; no polling")
			}
			require.EqualValues(t, 1, e.down.calls.Load())
		})
	}
}

func TestServerInterceptorFingerprintMismatch(t *testing.T) {
	e := newService(t)
	ctx := withKey(t.Context(), "order-42/charge")
	_, err := charge(ctx, e.conn, "10 EUR")
	require.NoError(t, err)
	_, err = charge(ctx, e.conn, "99 EUR")
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	info := errorInfo(t, err)
	require.Equal(t, client.ReasonFingerprintMismatch, info.GetReason())
	require.Empty(t, info.GetMetadata(), "no registry internals reach the service's callers")
	require.NotContains(t, status.Convert(err).Message(), "rpc:")
	require.ErrorIs(t, client.FromError(err), client.ErrFingerprintMismatch)
	require.EqualValues(t, 1, e.down.calls.Load())
}

func TestServerInterceptorRegistryDown(t *testing.T) {
	t.Run("fails closed", func(t *testing.T) {
		e := newService(t)
		require.NoError(t, e.reg.Stop())
		_, err := charge(withKey(t.Context(), "order-42/charge"), e.conn, "10 EUR")
		require.Equal(t, codes.Unavailable, status.Code(err))
		require.Equal(t, client.ReasonRegistryUnavailable, errorInfo(t, err).GetReason())
		require.Positive(t, retryInfo(t, err))
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("store down fails closed with its retry delay", func(t *testing.T) {
		e := newService(t)
		require.NoError(t, e.reg.StopStore())
		_, err := charge(withKey(t.Context(), "order-42/charge"), e.conn, "10 EUR")
		require.Equal(t, codes.Unavailable, status.Code(err))
		require.Equal(t, time.Second, retryInfo(t, err))
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("fail open serves", func(t *testing.T) {
		e := newService(t, client.WithRegistryUnavailable(client.FailOpen))
		require.NoError(t, e.reg.Stop())
		_, err := charge(withKey(t.Context(), "order-42/charge"), e.conn, "10 EUR")
		require.NoError(t, err)
		require.EqualValues(t, 1, e.down.calls.Load())
	})
}

func TestServerInterceptorKeys(t *testing.T) {
	t.Run("no key runs as it is by default", func(t *testing.T) {
		e := newService(t)
		for range 2 {
			_, err := charge(t.Context(), e.conn, "10 EUR")
			require.NoError(t, err)
		}
		require.EqualValues(t, 2, e.down.calls.Load())
		require.Empty(t, e.obs.allMetadata(), "no registry call without a key")
	})
	t.Run("no key is refused when required", func(t *testing.T) {
		e := newService(t, client.WithMissingKey(client.MissingKeyReject))
		_, err := charge(t.Context(), e.conn, "10 EUR")
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.Equal(t, client.ReasonMissingKey, errorInfo(t, err).GetReason())
		require.ErrorIs(t, client.FromError(err), client.ErrMissingKey)
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("invalid key", func(t *testing.T) {
		e := newService(t)
		// gRPC metadata carries printable ASCII only, so length is what the
		// registry can still refuse.
		for _, key := range []string{strings.Repeat("k", 257)} {
			_, err := charge(withKey(t.Context(), key), e.conn, "10 EUR")
			require.Equal(t, codes.InvalidArgument, status.Code(err), "key %q", key)
			var bad *errdetails.BadRequest
			for _, d := range status.Convert(err).Details() {
				if b, ok := d.(*errdetails.BadRequest); ok {
					bad = b
				}
			}
			require.NotNil(t, bad)
			require.Equal(t, client.KeyMetadata, bad.GetFieldViolations()[0].GetField())
		}
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("several different keys", func(t *testing.T) {
		e := newService(t)
		ctx := metadata.AppendToOutgoingContext(t.Context(), client.KeyMetadata, "a", client.KeyMetadata, "b")
		_, err := charge(ctx, e.conn, "10 EUR")
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.Zero(t, e.down.calls.Load())
	})
	t.Run("unselected methods pass through", func(t *testing.T) {
		e := newService(t, client.WithMethods(refundMethod))
		ctx := withKey(t.Context(), "order-42/charge")
		for range 2 {
			_, err := charge(ctx, e.conn, "10 EUR")
			require.NoError(t, err)
		}
		require.EqualValues(t, 2, e.down.calls.Load())
	})
	t.Run("misconfigured consumer is an internal error", func(t *testing.T) {
		e := newService(t, client.WithConsumer("not a valid consumer"))
		_, err := charge(withKey(t.Context(), "order-42/charge"), e.conn, "10 EUR")
		require.Equal(t, codes.Internal, status.Code(err))
		require.NotContains(t, status.Convert(err).Message(), "consumer")
	})
}

func TestServerInterceptorPassesStreamsThrough(t *testing.T) {
	e := newService(t, client.WithMissingKey(client.MissingKeyReject))
	got, err := watch(withKey(t.Context(), "stream-1"), e.conn, "s")
	require.NoError(t, err)
	require.Equal(t, []string{"s0", "s1", "s2"}, got)
	got, err = watch(t.Context(), e.conn, "s")
	require.NoError(t, err, "a stream without a key is not refused")
	require.Len(t, got, 3)
	require.Empty(t, e.obs.allMetadata(), "a stream never reaches the registry")
}

// TestServerInterceptorRace: 32 retries of one request arrive at once. The
// handler runs once; every request gets its response.
func TestServerInterceptorRace(t *testing.T) {
	e := newService(t, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond}))
	const n = 32
	var wg sync.WaitGroup
	var replays atomic.Int64
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			var header metadata.MD
			out, err := charge(withKey(t.Context(), "order-42/charge"), e.conn, "10 EUR", grpc.Header(&header))
			if assert.NoError(t, err) {
				assert.Equal(t, "charged:10 EUR", out.GetValue())
			}
			if len(header.Get(client.ReplayedHeader)) > 0 {
				replays.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, e.down.calls.Load())
	require.EqualValues(t, n-1, replays.Load())
}
