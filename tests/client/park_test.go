package client_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// parkKey claims k with c and parks it with reason, as a holder that sent
// a call whose outcome it cannot know would.
func parkKey(t *testing.T, c *client.Client, k client.Key, reason string) client.Claim {
	t.Helper()
	cl, err := c.Claim(t.Context(), client.ClaimParams{Key: k, Lease: 10 * time.Second})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeAcquired, cl.Outcome)
	rec, err := c.Park(t.Context(), k, cl.Fence(), reason)
	require.NoError(t, err)
	require.Equal(t, client.StateParked, rec.State)
	require.Equal(t, reason, rec.ParkReason)
	return cl
}

func TestParkTypedClient(t *testing.T) {
	reg := inprocess.Start(t)
	c := reg.Client
	k := client.Key{Consumer: inbox, Kind: client.KindOperation, Key: "op-1"}
	cl := parkKey(t, c, k, "sent, no answer")

	again, err := c.Claim(t.Context(), client.ClaimParams{Key: k})
	require.NoError(t, err, "a parked key is an outcome of Claim, not an error")
	require.Equal(t, client.OutcomeParked, again.Outcome)
	require.Zero(t, again.Token)
	require.Equal(t, "sent, no answer", again.Record.ParkReason)

	_, err = c.Complete(t.Context(), k, cl.Fence(), client.ResponseResult("t", []byte("late")))
	require.ErrorIs(t, err, client.ErrParked)
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = c.Park(t.Context(), k, client.Fence{Token: cl.Token, Secret: make([]byte, len(cl.Secret))}, "forged")
	require.ErrorIs(t, err, client.ErrClaimSecretInvalid)
	_, err = c.Park(t.Context(), k, cl.Fence(), "")
	require.ErrorIs(t, err, client.ErrInvalidArgument)
}

func TestOnceParked(t *testing.T) {
	reg := inprocess.Start(t)
	c := reg.Client
	parkKey(t, c, client.Key{Consumer: inbox, Kind: client.KindMessage, Key: "msg-1"}, "outcome unknown")

	never := func(context.Context, client.Attempt) ([]byte, error) {
		t.Error("the handler ran for a parked key")
		return nil, nil
	}
	res, err := c.Once(t.Context(), inbox, "msg-1", never)
	require.ErrorIs(t, err, client.ErrParked)
	var pe *client.ParkedError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "outcome unknown", pe.Record.ParkReason)
	require.Equal(t, client.StateParked, pe.Record.State)
	require.False(t, res.Ran || res.Replayed)
	require.False(t, client.IsFinal(err), "not acknowledged as done: dead-lettered or skipped")
	require.Equal(t, codes.FailedPrecondition, status.Code(err))

	// Waiting does not change it: a parked key is an answer, not a holder.
	_, err = c.Once(t.Context(), inbox, "msg-1", never, client.WithWaitInProgress(client.DefaultBackoff))
	require.ErrorIs(t, err, client.ErrParked)

	out := c.OnceBatch(t.Context(), inbox, msgs("msg-1", "msg-2"), func(_ context.Context, i int, a client.Attempt) ([]byte, error) {
		require.Equal(t, "msg-2", a.Key.Key, "the handler ran for a parked key")
		return []byte("ok"), nil
	})
	require.ErrorIs(t, out[0].Err, client.ErrParked)
	require.ErrorAs(t, out[0].Err, &pe)
	require.False(t, out[0].Ran)
	require.NoError(t, out[1].Err)
	require.True(t, out[1].Ran)
}

func TestClientInterceptorParked(t *testing.T) {
	e := newCaller(t, nil)
	parkKey(t, e.reg.Client, callKey("payment:op-1"), "provider timed out after send")
	ctx := client.WithIdempotencyKey(t.Context(), "payment:op-1")
	_, err := charge(ctx, e.conn, "10 EUR")
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.ErrorIs(t, err, client.ErrParked)
	require.ErrorIs(t, client.FromError(status.Convert(err).Err()), client.ErrParked, "rebuilt from the status by its reason")
	require.Zero(t, e.down.calls.Load(), "the downstream was not called")
}

func TestServerInterceptorParked(t *testing.T) {
	e := newService(t)
	parkKey(t, e.reg.Client, client.Key{Consumer: "rpc:" + downstreamService + "/Charge", Kind: client.KindOperation, Key: "op-9"}, "unknown")
	_, err := charge(withKey(t.Context(), "op-9"), e.conn, "10 EUR")
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, client.ReasonParked, errorInfo(t, err).GetReason())
	require.ErrorIs(t, client.FromError(err), client.ErrParked)
	require.Zero(t, e.down.calls.Load(), "the handler did not run")
}
