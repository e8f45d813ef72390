package client_test

// The interceptors as a service owner meets them (issue 24): no keyed call
// runs twice without saying so, a concurrent duplicate gets the first
// call's answer by default, a stored result that does not decode is an
// error naming the record and never a second run, and both sides answer
// each case with one status, one wording and one error type.

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

func TestKeyedStreamsAreRefused(t *testing.T) {
	t.Run("server side", func(t *testing.T) {
		reg := inprocess.Start(t)
		c, obs := observedClient(t, reg)
		addr, down := startDownstream(t,
			grpc.ChainUnaryInterceptor(client.UnaryServerInterceptor(c)),
			grpc.ChainStreamInterceptor(client.StreamServerInterceptor(c)))
		conn := dial(t, addr)

		_, err := watch(withKey(t.Context(), "watch-1"), conn, "s")
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.Equal(t, client.ReasonKeyUnsupported, errorInfo(t, err).GetReason())
		require.ErrorIs(t, client.FromError(err), client.ErrKeyUnsupported)
		require.Contains(t, status.Convert(err).Message(), watchMethod)
		var bad *errdetails.BadRequest
		for _, d := range status.Convert(err).Details() {
			if b, ok := d.(*errdetails.BadRequest); ok {
				bad = b
			}
		}
		require.NotNil(t, bad)
		require.Equal(t, client.KeyMetadata, bad.GetFieldViolations()[0].GetField())
		require.Zero(t, down.streams.Load(), "a keyed stream does not run")

		got, err := watch(t.Context(), conn, "s")
		require.NoError(t, err, "a stream without a key runs")
		require.Len(t, got, 3)
		require.EqualValues(t, 1, down.streams.Load())
		require.Empty(t, obs.allMetadata(), "a stream never reaches the registry")
	})
	t.Run("client side", func(t *testing.T) {
		reg := inprocess.Start(t)
		c, _ := observedClient(t, reg)
		addr, down := startDownstream(t)
		conn := dial(t, addr, grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(c)),
			grpc.WithStreamInterceptor(client.StreamClientInterceptor(c)))

		_, err := watch(client.WithIdempotencyKey(t.Context(), "watch-1"), conn, "s")
		require.ErrorIs(t, err, client.ErrKeyUnsupported)
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.Zero(t, down.streams.Load())
		_, err = watch(t.Context(), conn, "s")
		require.NoError(t, err)
		require.EqualValues(t, 1, down.streams.Load())
	})
	t.Run("a unary interceptor alone says which streams go unguarded", func(t *testing.T) {
		var logs syncBuffer
		reg := inprocess.Start(t)
		c, _ := observedClient(t, reg, client.WithLogger(slog.New(slog.NewJSONHandler(&logs, nil))))
		srv := grpc.NewServer(grpc.ChainUnaryInterceptor(client.UnaryServerInterceptor(c)))
		grpc_health_v1.RegisterHealthServer(srv, health.NewServer())
		addr := serve(t, srv)
		hc := grpc_health_v1.NewHealthClient(dial(t, addr))
		for range 3 {
			_, err := hc.Check(withKey(t.Context(), "check-1"), &grpc_health_v1.HealthCheckRequest{})
			require.NoError(t, err)
		}
		out := logs.String()
		require.Contains(t, out, "/grpc.health.v1.Health/Watch")
		require.Contains(t, out, `"level":"ERROR"`)
		require.Equal(t, 1, bytes.Count([]byte(out), []byte("/grpc.health.v1.Health/Watch")), "once per service: %s", out)
	})
}

func TestDuplicatesGetTheFirstAnswerByDefault(t *testing.T) {
	blockFirst := func(down *downstream) (entered, release chan struct{}) {
		entered, release = make(chan struct{}), make(chan struct{})
		down.setRespond(func(_ context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if n == 1 {
				close(entered)
				<-release
			}
			return wrapperspb.String("charged:" + req.GetValue()), nil
		})
		return entered, release
	}
	t.Run("server interceptor", func(t *testing.T) {
		e := newService(t) // no option: the default
		entered, release := blockFirst(e.down)
		ctx := withKey(t.Context(), "order-1")
		first := make(chan error, 1)
		go func() { _, err := charge(ctx, e.conn, "10 EUR"); first <- err }()
		recv(t, entered)
		type reply struct {
			out *wrapperspb.StringValue
			err error
		}
		second := make(chan reply, 1)
		go func() { out, err := charge(ctx, e.conn, "10 EUR"); second <- reply{out, err} }()
		e.obs.waitSent(t, "Claim", 3)
		close(release)
		require.NoError(t, recv(t, first))
		got := recv(t, second)
		require.NoError(t, got.err, "the duplicate gets the first call's answer, not ABORTED")
		require.Equal(t, "charged:10 EUR", got.out.GetValue())
		require.EqualValues(t, 1, e.down.calls.Load())
	})
	t.Run("client interceptor", func(t *testing.T) {
		e := newCaller(t, nil)
		entered, release := blockFirst(e.down)
		ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
		first := make(chan error, 1)
		go func() { _, err := charge(ctx, e.conn, "10 EUR"); first <- err }()
		recv(t, entered)
		second := make(chan error, 1)
		var replayed bool
		go func() { _, err := charge(ctx, e.conn, "10 EUR", client.Replayed(&replayed)); second <- err }()
		e.obs.waitSent(t, "Claim", 3)
		close(release)
		require.NoError(t, recv(t, first))
		require.NoError(t, recv(t, second))
		require.True(t, replayed)
		require.EqualValues(t, 1, e.down.calls.Load())
	})
	t.Run("the wait is bounded", func(t *testing.T) {
		e := newService(t, client.WithInProgressWait(100*time.Millisecond))
		_, release := blockFirst(e.down)
		defer close(release)
		ctx := withKey(t.Context(), "order-2")
		go func() { _, _ = charge(ctx, e.conn, "10 EUR") }()
		e.obs.waitSent(t, "Claim", 1)
		for e.down.calls.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		_, err := charge(ctx, e.conn, "10 EUR")
		require.Equal(t, codes.Aborted, status.Code(err), "past its wait the duplicate is answered IN_PROGRESS")
		require.ErrorIs(t, client.FromError(err), client.ErrInProgress)
	})
}

// TestInProgressRetryInfoIsAnEstimate: answered at once, a duplicate is
// told to come back after about how long the work takes, not after the
// whole lease the holder's heartbeat keeps renewing (29.7 s of 30 s in
// the report that asked for this).
func TestInProgressRetryInfoIsAnEstimate(t *testing.T) {
	e := newService(t, client.WithInProgressWait(0))
	blocked := make(chan struct{})
	entered := make(chan struct{}, 1)
	e.down.setRespond(func(_ context.Context, _ int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if req.GetValue() == "block" {
			entered <- struct{}{}
			<-blocked
		}
		return wrapperspb.String("ok"), nil
	})
	defer close(blocked)
	hold := func(key string) {
		go func() { _, _ = charge(withKey(t.Context(), key), e.conn, "block") }()
		recv(t, entered)
	}
	hold("a")
	_, err := charge(withKey(t.Context(), "a"), e.conn, "block")
	require.Equal(t, codes.Aborted, status.Code(err))
	require.Equal(t, client.DefaultInProgressRetry, retryInfo(t, err), "nothing seen yet: the default")

	// Runs of about 100ms teach the client how long the work takes.
	e.down.setRespond(func(_ context.Context, _ int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if req.GetValue() == "block" {
			entered <- struct{}{}
			<-blocked
		}
		time.Sleep(100 * time.Millisecond)
		return wrapperspb.String("ok"), nil
	})
	for _, k := range []string{"t1", "t2"} {
		_, err := charge(withKey(t.Context(), k), e.conn, "x")
		require.NoError(t, err)
	}
	hold("b")
	_, err = charge(withKey(t.Context(), "b"), e.conn, "block")
	require.Equal(t, codes.Aborted, status.Code(err))
	retry := retryInfo(t, err)
	require.GreaterOrEqual(t, retry, 100*time.Millisecond)
	require.Less(t, retry, 10*time.Second, "an estimate of the work, not the lease left (about 30s)")
}

// TestUnreadableStoredResult: a completed key whose stored bytes are not
// the reply type's wire format (JSON an operator stored by hand) is an
// error that names the record and says how to repair it, on every retry,
// and the call never runs again.
func TestUnreadableStoredResult(t *testing.T) {
	const req = "10 EUR"
	store := func(t *testing.T, reg *inprocess.Registry, k client.Key) {
		fp, err := client.DefaultFingerprint(chargeMethod, wrapperspb.String(req))
		require.NoError(t, err)
		cl, err := reg.Client.Claim(t.Context(), client.ClaimParams{Key: k, Fingerprint: fp, Lease: time.Minute})
		require.NoError(t, err)
		_, err = reg.Client.Complete(t.Context(), k, cl.Fence(),
			client.ResponseResult("google.protobuf.StringValue", []byte(`{"value":"charged"}`)))
		require.NoError(t, err)
	}
	t.Run("client interceptor", func(t *testing.T) {
		e := newCaller(t, nil)
		k := callKey("payment:op-1")
		store(t, e.reg, k)
		for range 2 {
			_, err := charge(client.WithIdempotencyKey(t.Context(), k.Key), e.conn, req)
			require.ErrorIs(t, err, client.ErrStoredResultUnreadable)
			require.Equal(t, codes.Internal, status.Code(err))
			var ce *client.Error
			require.ErrorAs(t, err, &ce)
			require.Equal(t, map[string]string{"consumer": k.Consumer, "kind": "KIND_OPERATION", "key": k.Key, "type": "google.protobuf.StringValue"}, ce.Metadata)
			require.Contains(t, ce.Message, "idemreg admin")
		}
		require.Zero(t, e.down.calls.Load(), "the call is never made again")
	})
	t.Run("server interceptor", func(t *testing.T) {
		e := newService(t)
		k := client.Key{Consumer: "rpc:" + downstreamService + "/Charge", Kind: client.KindOperation, Key: "order-1"}
		store(t, e.reg, k)
		for range 2 {
			_, err := charge(withKey(t.Context(), k.Key), e.conn, req)
			require.Equal(t, codes.Internal, status.Code(err))
			require.Equal(t, client.ReasonStoredResultUnreadable, errorInfo(t, err).GetReason())
			require.Empty(t, errorInfo(t, err).GetMetadata(), "no registry internals reach the service's callers")
			require.ErrorIs(t, client.FromError(err), client.ErrStoredResultUnreadable)
		}
		require.Zero(t, e.down.calls.Load(), "the handler never runs again")
	})
}

// TestBothSidesAnswerAlike: the same case reads the same, with the same
// code, reason and error type, from the client interceptor and (through
// FromError) from a service behind the server interceptor.
func TestBothSidesAnswerAlike(t *testing.T) {
	t.Run("fingerprint mismatch", func(t *testing.T) {
		caller := newCaller(t, nil)
		service := newService(t)
		ctx := client.WithIdempotencyKey(t.Context(), "k1")
		_, err := charge(ctx, caller.conn, "10 EUR")
		require.NoError(t, err)
		_, clientErr := charge(ctx, caller.conn, "99 EUR")
		_, err = charge(withKey(t.Context(), "k1"), service.conn, "10 EUR")
		require.NoError(t, err)
		_, serverErr := charge(withKey(t.Context(), "k1"), service.conn, "99 EUR")
		sameAnswer(t, clientErr, client.FromError(serverErr))
		require.ErrorIs(t, clientErr, client.ErrFingerprintMismatch)
	})
	t.Run("registry unavailable: typed, and the call was not run", func(t *testing.T) {
		caller := newCaller(t, nil)
		service := newService(t)
		require.NoError(t, caller.reg.Stop())
		require.NoError(t, service.reg.Stop())
		_, clientErr := charge(client.WithIdempotencyKey(t.Context(), "k1"), caller.conn, "10 EUR")
		_, serverErr := charge(withKey(t.Context(), "k1"), service.conn, "10 EUR")
		serverErr = client.FromError(serverErr)
		sameAnswer(t, clientErr, serverErr)
		for _, err := range []error{clientErr, serverErr} {
			var ue *client.UnavailableError
			require.ErrorAs(t, err, &ue)
			require.True(t, ue.NotRun, "the error says the call was not run: %v", err)
			require.Positive(t, ue.RetryAfter)
			require.Contains(t, err.Error(), "was not run")
		}
		var ue *client.UnavailableError
		require.ErrorAs(t, clientErr, &ue)
		require.Error(t, ue.Cause, "the client side keeps the registry call's own error")
		require.Zero(t, caller.down.calls.Load())
		require.Zero(t, service.down.calls.Load())
	})
}

func sameAnswer(t *testing.T, a, b error) {
	t.Helper()
	sa, sb := status.Convert(a), status.Convert(b)
	require.Equal(t, sa.Code(), sb.Code())
	require.Equal(t, sa.Message(), sb.Message())
	var ea, eb *client.Error
	switch {
	case errors.As(a, &ea) && errors.As(b, &eb):
		require.Equal(t, ea.Reason, eb.Reason)
	default:
		require.IsType(t, a, b)
	}
	require.Equal(t, a.Error(), b.Error())
}

// serve serves srv on a loopback listener.
func serve(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
