package watermill_test

import (
	"bytes"
	"errors"
	"testing"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	idemwm "github.com/idemreg/idemreg/client/watermill"
)

// The middleware called as the router calls it, without a router: what it
// returns is what the router publishes, and an error is a nack.

// A message without a key is nacked with ErrNoKey and the handler does not
// run; KeyFromMetadata keys by the field, so two UUIDs with one key are
// duplicates.
func TestKeyFromMetadata(t *testing.T) {
	c := newClient(t)
	consumer := consumerName(t)
	rs := &runs{}
	h := idemwm.New(c, consumer, idemwm.WithKey(idemwm.KeyFromMetadata("order"))).Middleware(producing(rs))

	_, err := h(message.NewMessage(wm.NewUUID(), []byte("no key")))
	require.ErrorIs(t, err, idemwm.ErrNoKey)

	first := message.NewMessage(wm.NewUUID(), []byte("order-9"))
	first.Metadata.Set("order", "order-9."+wm.NewUUID())
	out1, err := h(first)
	require.NoError(t, err)
	second := message.NewMessage(wm.NewUUID(), []byte("order-9"))
	second.Metadata.Set("order", first.Metadata.Get("order"))
	out2, err := h(second)
	require.NoError(t, err)
	require.Len(t, rs.of(first.Metadata.Get("order")), 1)
	require.Len(t, out1, 1)
	require.Len(t, out2, 1)
	require.Equal(t, out1[0].UUID, out2[0].UUID)
}

// With PayloadFingerprint, a message whose key is done but whose payload
// differs is nacked with ErrFingerprintMismatch instead of being answered
// with the first one's outcome.
func TestPayloadFingerprint(t *testing.T) {
	c := newClient(t)
	rs := &runs{}
	h := idemwm.New(c, consumerName(t), idemwm.WithFingerprint(idemwm.PayloadFingerprint)).Middleware(producing(rs))
	msg := message.NewMessage(wm.NewUUID(), []byte("amount=10"))
	_, err := h(msg)
	require.NoError(t, err)
	_, err = h(msg.Copy())
	require.NoError(t, err)
	other := message.NewMessage(msg.UUID, []byte("amount=1000"))
	_, err = h(other)
	require.ErrorIs(t, err, client.ErrFingerprintMismatch)
	require.Len(t, rs.of(msg.UUID), 1)
}

// Produced messages beyond MaxReplayBytes are returned by the first run
// but not stored: a duplicate is acked and publishes nothing.
func TestProducedMessagesTooLargeToReplay(t *testing.T) {
	c := newClient(t)
	consumer := consumerName(t)
	big := bytes.Repeat([]byte("x"), idemwm.MaxReplayBytes)
	h := idemwm.New(c, consumer).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(wm.NewUUID(), big)}, nil
	})
	msg := message.NewMessage(wm.NewUUID(), nil)
	out, err := h(msg)
	require.NoError(t, err)
	require.Len(t, out, 1)
	require.Equal(t, big, []byte(out[0].Payload))
	rec := lookup(t, c, consumer, msg.UUID)
	require.Equal(t, client.StateCompleted, rec.State)
	require.JSONEq(t, `{"omitted":1}`, string(rec.Result.Response.Data))

	out, err = h(msg.Copy())
	require.NoError(t, err)
	require.Empty(t, out)
}

// The handler's message carries the claim in its context while it runs,
// and its own context again afterwards.
func TestAttemptFromContext(t *testing.T) {
	c := newClient(t)
	consumer := consumerName(t)
	var got client.Attempt
	h := idemwm.New(c, consumer).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		a, ok := idemwm.AttemptFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no attempt")
		}
		got = a
		return nil, nil
	})
	msg := message.NewMessage(wm.NewUUID(), nil)
	_, err := h(msg)
	require.NoError(t, err)
	require.Equal(t, client.Key{Consumer: consumer, Kind: client.KindMessage, Key: msg.UUID}, got.Key)
	require.Equal(t, int64(1), got.Attempt)
	require.Positive(t, got.Token)
	_, ok := idemwm.AttemptFromContext(msg.Context())
	require.False(t, ok, "the claim's context outlived the handler")
}

// A handler that panics releases the key (the router recovers and nacks);
// the redelivery runs it again.
func TestPanicReleases(t *testing.T) {
	c := newClient(t)
	rs := &runs{}
	panicked := false
	ok := producing(rs)
	h := idemwm.New(c, consumerName(t)).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if !panicked {
			panicked = true
			panic("boom")
		}
		return ok(msg)
	})
	msg := message.NewMessage(wm.NewUUID(), nil)
	require.Panics(t, func() { _, _ = h(msg) })
	_, err := h(msg.Copy())
	require.NoError(t, err)
	got := rs.of(msg.UUID)
	require.Len(t, got, 1)
	require.Equal(t, int64(2), got[0].Attempt)
}
