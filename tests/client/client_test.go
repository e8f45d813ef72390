package client_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

var opKey = client.Key{Consumer: "billing.payment-worker", Kind: client.KindOperation, Key: "charge:op-1"}

func TestClientLifecycle(t *testing.T) {
	clock := &inprocess.Clock{}
	reg := inprocess.Start(t, inprocess.WithClock(clock.Now), inprocess.WithClientOptions(client.WithHolder("pod-a")))
	c, ctx := reg.Client, t.Context()

	first, err := c.Claim(ctx, client.ClaimParams{Key: opKey, Fingerprint: []byte("fp-1"), Lease: 10 * time.Second, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeAcquired, first.Outcome)
	require.Positive(t, first.Token)
	require.Equal(t, opKey, first.Record.Key)
	require.Equal(t, client.StateInProgress, first.Record.State)
	require.Equal(t, "pod-a", first.Record.Holder)
	require.EqualValues(t, 1, first.Record.Attempt)
	require.Equal(t, []byte("fp-1"), first.Record.Fingerprint)
	require.Equal(t, time.Hour, first.Record.ExpiresAt.Sub(first.Record.LeaseExpiresAt))
	require.Nil(t, first.Record.Result)

	busy, err := c.Claim(ctx, client.ClaimParams{Key: opKey, Fingerprint: []byte("fp-1"), Holder: "pod-b"})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeInProgress, busy.Outcome)
	require.Zero(t, busy.Token)
	require.Zero(t, busy.Record.Token, "another holder's token is never handed out")
	require.Positive(t, busy.RetryAfter)
	require.LessOrEqual(t, busy.RetryAfter, 10*time.Second)

	before := first.Record.LeaseExpiresAt
	clock.Advance(time.Second)
	ext, err := c.Extend(ctx, opKey, first.Fence(), 20*time.Second)
	require.NoError(t, err)
	require.True(t, ext.LeaseExpiresAt.After(before))

	declined := status.New(codes.FailedPrecondition, "card declined")
	declined, err = declined.WithDetails(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
	require.NoError(t, err)
	done, err := c.Complete(ctx, opKey, first.Fence(), client.FailureResult(declined))
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, done.State)
	require.False(t, done.CompletedAt.IsZero())

	replay, err := c.Claim(ctx, client.ClaimParams{Key: opKey})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeCompleted, replay.Outcome)
	require.NotNil(t, replay.Record.Result)
	require.Nil(t, replay.Record.Result.Response)
	got := status.Convert(replay.Record.Result.Err())
	require.Equal(t, codes.FailedPrecondition, got.Code())
	require.Equal(t, "card declined", got.Message())
	require.Len(t, got.Details(), 1)
	require.Equal(t, "CARD_DECLINED", got.Details()[0].(*errdetails.ErrorInfo).GetReason())

	// Repeating Complete with the same token returns the first result.
	again, err := c.Complete(ctx, opKey, first.Fence(), client.ResponseResult("x", []byte("other")))
	require.NoError(t, err)
	require.NotNil(t, again.Result.Failure)

	looked, err := c.Lookup(ctx, opKey)
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, looked.State)
	require.NotNil(t, c.API())
}

func TestMessageResult(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	cl, err := c.Claim(ctx, client.ClaimParams{Key: opKey})
	require.NoError(t, err)
	r, err := client.MessageResult(status.New(codes.OK, "").Proto())
	require.NoError(t, err)
	require.Equal(t, "google.rpc.Status", r.Response.Type)
	_, err = c.Complete(ctx, opKey, cl.Fence(), r)
	require.NoError(t, err)
	rec, err := c.Lookup(ctx, opKey)
	require.NoError(t, err)
	require.Equal(t, "google.rpc.Status", rec.Result.Response.Type)
	require.NoError(t, rec.Result.Err())
	require.Equal(t, codes.Unknown, client.FailureResult(status.New(codes.OK, "odd")).Failure.Code(),
		"a failure always carries an error code")
}

func TestTypedErrors(t *testing.T) {
	clock := &inprocess.Clock{}
	reg := inprocess.Start(t, inprocess.WithClock(clock.Now))
	c, ctx := reg.Client, t.Context()
	msgKey := client.Key{Consumer: "orders.inbox", Kind: client.KindMessage, Key: "msg-1"}

	first, err := c.Claim(ctx, client.ClaimParams{Key: msgKey, Fingerprint: []byte("a"), Lease: 5 * time.Second})
	require.NoError(t, err)

	for _, tc := range []struct {
		name     string
		call     func() error
		sentinel error
		code     codes.Code
		reason   string
	}{
		{"fingerprint mismatch", func() error {
			_, err := c.Claim(ctx, client.ClaimParams{Key: msgKey, Fingerprint: []byte("b")})
			return err
		}, client.ErrFingerprintMismatch, codes.FailedPrecondition, client.ReasonFingerprintMismatch},
		{"claim secret invalid", func() error {
			_, err := c.Release(ctx, msgKey, client.Fence{Token: first.Token - 1, Secret: first.Secret})
			return err
		}, client.ErrClaimSecretInvalid, codes.FailedPrecondition, client.ReasonClaimSecretInvalid},
		{"not found", func() error {
			_, err := c.Lookup(ctx, client.Key{Consumer: "orders.inbox", Kind: client.KindMessage, Key: "absent"})
			return err
		}, client.ErrNotFound, codes.NotFound, client.ReasonNotFound},
		{"invalid argument", func() error {
			_, err := c.Claim(ctx, client.ClaimParams{Key: client.Key{Consumer: "bad consumer!", Kind: client.KindMessage}})
			return err
		}, client.ErrInvalidArgument, codes.InvalidArgument, client.ReasonInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			require.ErrorIs(t, err, tc.sentinel)
			var e *client.Error
			require.ErrorAs(t, err, &e)
			require.Equal(t, tc.code, e.Code)
			require.Equal(t, tc.reason, e.Reason)
			require.Equal(t, tc.code, status.Code(err), "status.Code still works on a typed error")
			for _, other := range []error{client.ErrFingerprintMismatch, client.ErrLeaseLost, client.ErrClaimSecretInvalid, client.ErrNotFound, client.ErrInvalidArgument, client.ErrUnavailable} {
				if other != tc.sentinel {
					require.NotErrorIs(t, err, other)
				}
			}
		})
	}

	t.Run("field violations and metadata", func(t *testing.T) {
		_, err := c.Claim(ctx, client.ClaimParams{Key: client.Key{Consumer: "", Kind: client.KindMessage, Key: ""}})
		var e *client.Error
		require.ErrorAs(t, err, &e)
		fields := map[string]bool{}
		for _, v := range e.FieldViolations {
			fields[v.Field] = true
			require.NotEmpty(t, v.Description)
		}
		require.True(t, fields["consumer"] && fields["key"], "violations: %+v", e.FieldViolations)

		_, err = c.Claim(ctx, client.ClaimParams{Key: msgKey, Fingerprint: []byte("b")})
		require.ErrorAs(t, err, &e)
		require.Equal(t, "msg-1", e.Metadata["key"])
	})

	t.Run("already completed", func(t *testing.T) {
		_, err := c.Complete(ctx, msgKey, first.Fence(), client.ResponseResult("", nil))
		require.NoError(t, err)
		_, err = c.Extend(ctx, msgKey, first.Fence(), 0)
		require.ErrorIs(t, err, client.ErrAlreadyCompleted)
		_, err = c.Release(ctx, msgKey, first.Fence())
		require.ErrorIs(t, err, client.ErrAlreadyCompleted)
	})

	t.Run("deadline", func(t *testing.T) {
		dctx, cancel := context.WithTimeout(ctx, time.Nanosecond)
		defer cancel()
		<-dctx.Done()
		_, err := c.Lookup(dctx, msgKey)
		require.ErrorIs(t, err, client.ErrDeadlineExceeded)
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})

	t.Run("canceled", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err := c.Lookup(cctx, msgKey)
		require.ErrorIs(t, err, client.ErrCanceled)
		require.ErrorIs(t, err, context.Canceled)
	})
}

func TestUnavailableErrors(t *testing.T) {
	t.Run("store down: RetryInfo from the registry", func(t *testing.T) {
		reg := inprocess.Start(t)
		require.NoError(t, reg.StopStore())
		_, err := reg.Client.Claim(t.Context(), client.ClaimParams{Key: opKey})
		require.ErrorIs(t, err, client.ErrUnavailable)
		var ue *client.UnavailableError
		require.ErrorAs(t, err, &ue)
		require.Equal(t, time.Second, ue.RetryAfter)
		require.Equal(t, client.ReasonStoreUnavailable, ue.Err.Reason)
		var e *client.Error
		require.ErrorAs(t, err, &e, "an UnavailableError unwraps to its *Error")
		require.Equal(t, codes.Unavailable, status.Code(err))
	})
	t.Run("registry down: no reason, no delay", func(t *testing.T) {
		reg := inprocess.Start(t)
		require.NoError(t, reg.Stop())
		_, err := reg.Client.Claim(t.Context(), client.ClaimParams{Key: opKey})
		var ue *client.UnavailableError
		require.ErrorAs(t, err, &ue)
		require.Zero(t, ue.RetryAfter)
		require.Empty(t, ue.Err.Reason)
		require.ErrorIs(t, err, client.ErrUnavailable)
	})
}

func TestFromError(t *testing.T) {
	require.NoError(t, client.FromError(nil))
	plain := errors.New("plain")
	require.Same(t, plain, client.FromError(plain), "an error without a status is returned as it is")

	inProgress := (&client.InProgressError{RetryAfter: 3 * time.Second}).GRPCStatus().Err()
	got := client.FromError(inProgress)
	require.ErrorIs(t, got, client.ErrInProgress)
	var ie *client.InProgressError
	require.ErrorAs(t, got, &ie)
	require.Equal(t, 3*time.Second, ie.RetryAfter)
	require.Equal(t, codes.Aborted, status.Code(got))

	other := status.Error(codes.Unimplemented, "unknown service")
	var e *client.Error
	require.ErrorAs(t, client.FromError(other), &e)
	require.Equal(t, codes.Unimplemented, e.Code)
	for _, s := range []error{client.ErrUnavailable, client.ErrInternal, client.ErrNotFound} {
		require.NotErrorIs(t, client.FromError(other), s, "a status that is not the registry's matches no sentinel")
	}
}

func TestFinal(t *testing.T) {
	require.NoError(t, client.Final(nil))
	base := errors.New("bad message")
	f := client.Final(base)
	require.True(t, client.IsFinal(f))
	require.ErrorIs(t, f, base)
	require.False(t, client.IsFinal(base))

	st := status.New(codes.InvalidArgument, "amount must be positive")
	fs := client.Final(st.Err())
	require.Equal(t, codes.InvalidArgument, status.Code(fs))
	require.Equal(t, "amount must be positive", status.Convert(fs).Message(), "Final keeps a status as it is")
}
