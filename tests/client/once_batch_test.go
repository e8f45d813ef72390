package client_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

func msgs(ids ...string) []client.BatchMessage {
	out := make([]client.BatchMessage, len(ids))
	for i, id := range ids {
		out[i] = client.BatchMessage{ID: id, Fingerprint: []byte("fp:" + id)}
	}
	return out
}

// TestOnceBatch: one batch holding every case, claimed in one BatchClaim
// and recorded in one BatchComplete; each message's result is what Once
// would have given it, and the registry's state afterwards proves it.
func TestOnceBatch(t *testing.T) {
	reg := inprocess.Start(t)
	c, obs := observedClient(t, reg)
	ctx := t.Context()
	// Earlier deliveries: one applied, one refused for good, one at work.
	_, err := reg.Client.Once(ctx, inbox, "done-ok", func(context.Context, client.Attempt) ([]byte, error) { return []byte("old"), nil },
		client.WithMessageFingerprint([]byte("fp:done-ok")))
	require.NoError(t, err)
	_, err = reg.Client.Once(ctx, inbox, "done-final", func(context.Context, client.Attempt) ([]byte, error) {
		return nil, client.Final(status.Error(codes.InvalidArgument, "bad amount"))
	}, client.WithMessageFingerprint([]byte("fp:done-final")))
	require.True(t, client.IsFinal(err))
	release, done := blocking(t, reg.Client, "busy", client.WithLease(time.Minute), client.WithMessageFingerprint([]byte("fp:busy")))
	defer func() { close(release); <-done }()

	batch := msgs("new-ok", "done-ok", "new-final", "new-retry", "busy", "done-final", "new-ok", "new-ok")
	batch[7].Fingerprint = []byte("other content")
	runs := map[string]int{}
	res := c.OnceBatch(ctx, inbox, batch, func(_ context.Context, i int, a client.Attempt) ([]byte, error) {
		id := batch[i].ID
		runs[id]++
		require.Equal(t, id, a.Key.Key)
		require.Positive(t, a.Token)
		switch id {
		case "new-ok":
			return []byte("applied"), nil
		case "new-final":
			return nil, client.Final(status.Error(codes.FailedPrecondition, "account closed"))
		default:
			return nil, errors.New("database briefly down")
		}
	})
	require.Len(t, res, len(batch))
	require.Equal(t, map[string]int{"new-ok": 1, "new-final": 1, "new-retry": 1}, runs, "the handler ran once per acquired id, never for the others")

	tests := []struct {
		name           string
		i              int
		ran, replayed  bool
		dup            bool
		data           string
		ack            bool // err == nil || IsFinal
		errIs          error
		stateCompleted bool
	}{
		{name: "acquired and applied", i: 0, ran: true, data: "applied", ack: true, stateCompleted: true},
		{name: "completed before: replayed", i: 1, replayed: true, data: "old", ack: true, stateCompleted: true},
		{name: "final failure stored", i: 2, ran: true, ack: true, stateCompleted: true},
		{name: "retryable failure released", i: 3, ran: true, errIs: nil},
		{name: "in progress elsewhere", i: 4, errIs: client.ErrInProgress},
		{name: "final failure before: replayed", i: 5, replayed: true, ack: true, stateCompleted: true},
		{name: "same id again: the first's outcome", i: 6, replayed: true, dup: true, data: "applied", ack: true, stateCompleted: true},
		{name: "same id, other content", i: 7, dup: true, errIs: client.ErrFingerprintMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := res[tt.i]
			require.Equal(t, tt.ran, r.Ran, "ran")
			require.Equal(t, tt.replayed, r.Replayed, "replayed")
			require.Equal(t, tt.dup, r.Duplicate, "duplicate")
			require.Equal(t, tt.data, string(r.Data))
			require.Equal(t, tt.ack, r.Err == nil || client.IsFinal(r.Err), "acknowledge: %v", r.Err)
			if tt.errIs != nil {
				require.ErrorIs(t, r.Err, tt.errIs)
			}
			require.Equal(t, tt.stateCompleted, r.Record.State == client.StateCompleted)
		})
	}
	var ie *client.InProgressError
	require.ErrorAs(t, res[4].Err, &ie)
	require.Positive(t, ie.RetryAfter)
	require.Equal(t, codes.FailedPrecondition, status.Code(res[2].Err), "the handler's own final error")

	require.Equal(t, []int{6}, obs.sentSizes("BatchClaim"), "one claim per distinct id, in one call")
	require.Equal(t, []int{2}, obs.sentSizes("BatchComplete"), "the success and the final failure, in one call")
	require.Empty(t, obs.sentSizes("Claim"), "no unary Claim")
	require.Empty(t, obs.sentSizes("Complete"), "no unary Complete")

	// The registry agrees: a redelivery replays what was recorded and runs
	// what was released.
	never := func(context.Context, client.Attempt) ([]byte, error) {
		t.Error("a recorded message ran again")
		return nil, nil
	}
	r, err := c.Once(ctx, inbox, "new-ok", never, client.WithMessageFingerprint([]byte("fp:new-ok")))
	require.NoError(t, err)
	require.True(t, r.Replayed)
	require.Equal(t, "applied", string(r.Data))
	_, err = c.Once(ctx, inbox, "new-final", never, client.WithMessageFingerprint([]byte("fp:new-final")))
	require.True(t, client.IsFinal(err))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	r, err = c.Once(ctx, inbox, "new-retry", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil },
		client.WithMessageFingerprint([]byte("fp:new-retry")))
	require.NoError(t, err)
	require.True(t, r.Ran, "released at once: the redelivery runs without waiting out a lease")
}

// TestOnceBatchWaitsInProgress: with WithWaitInProgress a message another
// holder is working on is claimed again after the acquired ones are done,
// and gets the holder's outcome as soon as it is stored.
func TestOnceBatchWaitsInProgress(t *testing.T) {
	reg := inprocess.Start(t)
	c, obs := observedClient(t, reg)
	release, done := blocking(t, reg.Client, "busy", client.WithLease(time.Minute))
	batch := []client.BatchMessage{{ID: "free"}, {ID: "busy"}}
	got := make(chan []client.BatchResult, 1)
	ran := make(chan string, 2)
	go func() {
		got <- c.OnceBatch(t.Context(), inbox, batch, func(_ context.Context, i int, _ client.Attempt) ([]byte, error) {
			ran <- batch[i].ID
			return nil, nil
		}, client.WithWaitInProgress(client.Backoff{}))
	}()
	// The second BatchClaim is the wait for "busy": "free" is done by then.
	obs.waitSent(t, "BatchClaim", 2)
	require.Equal(t, "free", recv(t, ran))
	require.Len(t, obs.sentSizes("Complete"), 1, "the acquired message was recorded (one outcome: a unary Complete) before the wait")
	close(release)
	require.NoError(t, recv(t, done))
	res := recv(t, got)
	require.NoError(t, res[0].Err)
	require.True(t, res[0].Ran)
	require.NoError(t, res[1].Err)
	require.True(t, res[1].Replayed)
	require.Equal(t, "first", string(res[1].Data))
	require.Equal(t, []int{2, 1}, obs.sentSizes("BatchClaim"))
	require.Zero(t, obs.inProgressAnswers())
	select {
	case id := <-ran:
		t.Fatalf("%s ran twice", id)
	default:
	}
}

// TestOnceBatchPanic: a handler that panics loses nothing already done:
// the messages before it are recorded, it and those after it are released
// unrun, and the panic goes on.
func TestOnceBatchPanic(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	batch := msgs("p-1", "p-2", "p-3")
	var ran []string
	require.PanicsWithValue(t, "boom", func() {
		c.OnceBatch(ctx, inbox, batch, func(_ context.Context, i int, _ client.Attempt) ([]byte, error) {
			ran = append(ran, batch[i].ID)
			if batch[i].ID == "p-2" {
				panic("boom")
			}
			return []byte("done"), nil
		})
	})
	require.Equal(t, []string{"p-1", "p-2"}, ran)

	res := c.OnceBatch(ctx, inbox, batch, func(_ context.Context, i int, _ client.Attempt) ([]byte, error) {
		require.NotEqual(t, "p-1", batch[i].ID, "p-1 was recorded before the panic")
		return []byte("again"), nil
	})
	require.True(t, res[0].Replayed)
	require.Equal(t, "done", string(res[0].Data))
	for _, r := range res[1:] {
		require.NoError(t, r.Err)
		require.True(t, r.Ran, "released, not left to its lease")
	}
}

// TestOnceBatchSplits: a batch above the registry's item limit goes in
// calls of at most MaxBatchItems, and every message is handled once.
func TestOnceBatchSplits(t *testing.T) {
	reg := inprocess.Start(t)
	c, obs := observedClient(t, reg)
	const n = 2*client.MaxBatchItems + 1
	batch := make([]client.BatchMessage, n)
	for i := range batch {
		batch[i] = client.BatchMessage{ID: fmt.Sprintf("split-%04d", i)}
	}
	runs := make([]int, n)
	res := c.OnceBatch(t.Context(), inbox, batch, func(_ context.Context, i int, a client.Attempt) ([]byte, error) {
		runs[i]++
		return []byte(a.Key.Key), nil
	})
	for i, r := range res {
		require.NoError(t, r.Err)
		require.True(t, r.Ran)
		require.Equal(t, batch[i].ID, string(r.Data), "results are in batch order")
		require.Equal(t, 1, runs[i])
	}
	require.Equal(t, []int{500, 500, 1}, obs.sentSizes("BatchClaim"))
	require.Equal(t, []int{500, 500, 1}, obs.sentSizes("BatchComplete"))
}

// TestOnceBatchKeepsWaitingClaims: a message waiting its turn behind a
// slow one keeps its claim: its lease is extended from its acquisition.
func TestOnceBatchKeepsWaitingClaims(t *testing.T) {
	reg := inprocess.Start(t, shortLeases())
	c, ctx := reg.Client, t.Context()
	const lease = 100 * time.Millisecond
	batch := msgs("slow", "next")
	next := client.Key{Consumer: inbox, Kind: client.KindMessage, Key: "next"}
	res := c.OnceBatch(ctx, inbox, batch, func(ctx context.Context, i int, _ client.Attempt) ([]byte, error) {
		if batch[i].ID != "slow" {
			return nil, nil
		}
		first, err := c.Lookup(ctx, next)
		require.NoError(t, err)
		eventually(t, func() bool {
			rec, err := c.Lookup(ctx, next)
			return err == nil && rec.LeaseExpiresAt.After(first.LeaseExpiresAt)
		}, "the waiting message's lease to be extended")
		return nil, nil
	}, client.WithLease(lease))
	for _, r := range res {
		require.NoError(t, r.Err)
		require.True(t, r.Ran)
	}
}

// TestBatchClaimTypedErrors: BatchClaim's per-item errors are the typed
// errors Claim returns.
func TestBatchClaimTypedErrors(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	_, err := c.Claim(ctx, client.ClaimParams{Key: msgKey, Fingerprint: []byte("a")})
	require.NoError(t, err)
	res, err := c.BatchClaim(ctx, []client.ClaimParams{
		{Key: msgKey, Fingerprint: []byte("b")},
		{Key: client.Key{Consumer: inbox, Kind: client.KindMessage, Key: ""}},
		{Key: client.Key{Consumer: inbox, Kind: client.KindMessage, Key: "fresh"}},
		{Key: client.Key{Consumer: inbox, Kind: client.KindMessage, Key: "fresh"}},
	})
	require.NoError(t, err)
	require.ErrorIs(t, res[0].Err, client.ErrFingerprintMismatch)
	require.ErrorIs(t, res[1].Err, client.ErrInvalidArgument)
	require.NoError(t, res[2].Err)
	require.Equal(t, client.OutcomeAcquired, res[2].Claim.Outcome)
	require.NoError(t, res[3].Err)
	require.Equal(t, client.OutcomeInProgress, res[3].Claim.Outcome, "the second sees the first's claim")

	done, err := c.BatchComplete(ctx, []client.CompleteParams{
		{Key: res[2].Claim.Record.Key, Fence: res[2].Claim.Fence(), Result: client.ResponseResult("", []byte("x"))},
		{Key: res[2].Claim.Record.Key, Fence: client.Fence{Token: res[2].Claim.Token}, Result: client.ResponseResult("", []byte("y"))},
	})
	require.NoError(t, err)
	require.NoError(t, done[0].Err)
	require.Equal(t, client.StateCompleted, done[0].Record.State)
	require.Error(t, done[1].Err, "a Complete without the claim's secret is refused")
}

// TestOnceBatchContextEnds: once the caller's context ends, the messages
// not yet run are released unrun, so a redelivery runs them at once.
func TestOnceBatchContextEnds(t *testing.T) {
	reg := inprocess.Start(t)
	c := reg.Client
	ctx, cancel := context.WithCancel(t.Context())
	batch := msgs("c-1", "c-2")
	var ran []string
	res := c.OnceBatch(ctx, inbox, batch, func(_ context.Context, i int, _ client.Attempt) ([]byte, error) {
		ran = append(ran, batch[i].ID)
		cancel() // the consumer is stopping
		return nil, nil
	})
	require.Equal(t, []string{"c-1"}, ran)
	require.NoError(t, res[0].Err, "what ran is recorded even though the context ended")
	require.Equal(t, client.StateCompleted, res[0].Record.State)
	require.ErrorIs(t, res[1].Err, context.Canceled)
	require.False(t, res[1].Ran)

	r, err := c.Once(t.Context(), inbox, "c-2", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil },
		client.WithMessageFingerprint([]byte("fp:c-2")))
	require.NoError(t, err)
	require.True(t, r.Ran, "released, not left to its lease")
}
