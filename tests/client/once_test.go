package client_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

const inbox = "ledger.payments-inbox"

var msgKey = client.Key{Consumer: inbox, Kind: client.KindMessage, Key: "msg-1"}

func TestOnceRunsAndReplays(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	var runs atomic.Int64
	var seen client.Attempt
	fn := func(ctx context.Context, a client.Attempt) ([]byte, error) {
		runs.Add(1)
		seen = a
		return []byte("applied"), nil
	}

	res, err := c.Once(ctx, inbox, "msg-1", fn)
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.False(t, res.Replayed)
	require.Equal(t, "applied", string(res.Data))
	require.Equal(t, client.StateCompleted, res.Record.State)
	require.Equal(t, msgKey, seen.Key)
	require.Positive(t, seen.Token)
	require.EqualValues(t, 1, seen.Attempt)
	require.Equal(t, 7*24*time.Hour, res.Record.ExpiresAt.Sub(res.Record.CompletedAt), "a message key gets the message retention")

	for range 3 {
		res, err = c.Once(ctx, inbox, "msg-1", fn)
		require.NoError(t, err)
		require.False(t, res.Ran)
		require.True(t, res.Replayed)
		require.Equal(t, "applied", string(res.Data))
	}
	require.EqualValues(t, 1, runs.Load())

	// Another consumer has its own key space.
	res, err = c.Once(ctx, "audit.payments-inbox", "msg-1", fn)
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.EqualValues(t, 2, runs.Load())
}

// TestOnceLostClaimReply: the registry acquires the key but the reply is
// lost, twice. Once repeats the Claim with the same request id, gets the
// token the first Claim acquired, and runs the work once, at attempt 1,
// instead of finding the key in progress under a lease nobody holds.
func TestOnceLostClaimReply(t *testing.T) {
	reg := inprocess.Start(t)
	c, sent := lossyClient(t, reg, 2)
	var runs atomic.Int64
	var seen client.Attempt
	res, err := c.Once(t.Context(), inbox, "msg-lost", func(_ context.Context, a client.Attempt) ([]byte, error) {
		runs.Add(1)
		seen = a
		return []byte("applied"), nil
	})
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 1, seen.Attempt, "the first Claim's acquisition, not a takeover")
	require.EqualValues(t, 1, res.Record.Attempt)
	ids := sent()
	require.Len(t, ids, 3, "two lost replies, then the answer")
	require.NotEmpty(t, ids[0])
	require.Equal(t, []string{ids[0], ids[0], ids[0]}, ids, "one request id for the repeats of one claim")

	// Another call is another claim, with an id of its own.
	_, err = c.Once(t.Context(), inbox, "msg-lost-2", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil })
	require.NoError(t, err)
	ids = sent()
	require.NotEqual(t, ids[0], ids[len(ids)-1])
}

// TestClaimRequestIDIsNotShared: two callers racing on one key each with
// their own request id, one of them losing its reply: the repeat of the
// lost one gets its token only if it won; the other never gets a token it
// did not win. Exactly one runs the work.
func TestClaimRequestIDIsNotShared(t *testing.T) {
	reg := inprocess.Start(t)
	for round := range 10 {
		lossy, _ := lossyClient(t, reg, 1)
		plain := reg.Client
		var runs atomic.Int64
		fn := func(context.Context, client.Attempt) ([]byte, error) {
			runs.Add(1)
			return []byte("done"), nil
		}
		id := fmt.Sprintf("race-%d", round)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, c := range []*client.Client{lossy, plain} {
			wg.Go(func() {
				_, errs[i] = c.Once(t.Context(), inbox, id, fn, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond}))
			})
		}
		wg.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		require.EqualValues(t, 1, runs.Load(), "round %d", round)
	}
}

func TestOnceOptions(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	ok := func(context.Context, client.Attempt) ([]byte, error) { return nil, nil }

	res, err := c.Once(ctx, inbox, "op-1", ok, client.WithKind(client.KindOperation), client.WithRetention(2*time.Hour), client.WithLease(5*time.Second))
	require.NoError(t, err)
	require.Equal(t, client.KindOperation, res.Record.Kind)
	require.Equal(t, 2*time.Hour, res.Record.ExpiresAt.Sub(res.Record.CompletedAt))

	_, err = c.Once(ctx, inbox, "msg-fp", ok, client.WithMessageFingerprint([]byte("sha-of-body-1")))
	require.NoError(t, err)
	res, err = c.Once(ctx, inbox, "msg-fp", ok, client.WithMessageFingerprint([]byte("sha-of-body-2")))
	require.ErrorIs(t, err, client.ErrFingerprintMismatch, "the same message id with other content is not a duplicate")
	require.False(t, res.Ran || res.Replayed)
}

func TestOnceFinalFailureIsReplayed(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	var runs atomic.Int64

	t.Run("status", func(t *testing.T) {
		fn := func(context.Context, client.Attempt) ([]byte, error) {
			runs.Add(1)
			return nil, client.Final(status.Error(codes.InvalidArgument, "amount must be positive"))
		}
		res, err := c.Once(ctx, inbox, "bad-1", fn)
		require.True(t, res.Ran)
		require.True(t, client.IsFinal(err))
		require.Equal(t, client.StateCompleted, res.Record.State)

		res, err = c.Once(ctx, inbox, "bad-1", fn)
		require.True(t, res.Replayed)
		require.False(t, res.Ran)
		require.True(t, client.IsFinal(err), "a replayed failure is final: the consumer acknowledges the message")
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.Equal(t, "amount must be positive", status.Convert(err).Message())
		require.EqualError(t, err, status.Error(codes.InvalidArgument, "amount must be positive").Error())
		require.EqualValues(t, 1, runs.Load())
	})

	t.Run("plain error", func(t *testing.T) {
		fn := func(context.Context, client.Attempt) ([]byte, error) {
			return nil, client.Final(errors.New("unknown account"))
		}
		_, err := c.Once(ctx, inbox, "bad-2", fn)
		require.EqualError(t, err, "unknown account")
		res, err := c.Once(ctx, inbox, "bad-2", fn)
		require.True(t, res.Replayed)
		require.EqualError(t, err, "unknown account", "the replay reads like the original")
		require.Equal(t, codes.Unknown, status.Code(err))
		require.Equal(t, "unknown account", status.Convert(err).Message())
	})
}

func TestOnceRetryableErrorReleases(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	dbDown := errors.New("ledger database unavailable")
	var attempts []client.Attempt
	fn := func(_ context.Context, a client.Attempt) ([]byte, error) {
		attempts = append(attempts, a)
		if len(attempts) == 1 {
			return nil, dbDown
		}
		return []byte("ok"), nil
	}

	res, err := c.Once(ctx, inbox, "msg-1", fn)
	require.ErrorIs(t, err, dbDown)
	require.False(t, client.IsFinal(err))
	require.True(t, res.Ran)

	// Released: the redelivery runs at once, with a larger token.
	res, err = c.Once(ctx, inbox, "msg-1", fn)
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.Len(t, attempts, 2)
	require.EqualValues(t, 2, attempts[1].Attempt)
	require.Greater(t, attempts[1].Token, attempts[0].Token)
}

func TestOncePanicReleases(t *testing.T) {
	reg := inprocess.Start(t)
	c, ctx := reg.Client, t.Context()
	func() {
		defer func() { require.Equal(t, "boom", recover()) }()
		_, _ = c.Once(ctx, inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) { panic("boom") })
	}()
	res, err := c.Once(ctx, inbox, "msg-1", func(_ context.Context, a client.Attempt) ([]byte, error) {
		require.EqualValues(t, 2, a.Attempt)
		return nil, nil
	})
	require.NoError(t, err)
	require.True(t, res.Ran)
}

// blocking runs a Once whose handler blocks until release is closed, and
// returns once the handler has started.
func blocking(t *testing.T, c *client.Client, id string, opts ...client.OnceOption) (release chan struct{}, done <-chan error) {
	t.Helper()
	started, release, errc := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := c.Once(context.Background(), inbox, id, func(ctx context.Context, _ client.Attempt) ([]byte, error) {
			close(started)
			select {
			case <-release:
				return []byte("first"), nil
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}, opts...)
		errc <- err
	}()
	recv(t, started)
	return release, errc
}

func TestOnceInProgress(t *testing.T) {
	reg := inprocess.Start(t)
	c := reg.Client
	release, done := blocking(t, c, "msg-1", client.WithLease(10*time.Second))

	never := func(context.Context, client.Attempt) ([]byte, error) { t.Error("a duplicate ran"); return nil, nil }
	res, err := c.Once(t.Context(), inbox, "msg-1", never)
	require.ErrorIs(t, err, client.ErrInProgress)
	var ie *client.InProgressError
	require.ErrorAs(t, err, &ie)
	require.Positive(t, ie.RetryAfter)
	require.LessOrEqual(t, ie.RetryAfter, 10*time.Second)
	require.False(t, res.Ran || res.Replayed)
	require.Equal(t, codes.Aborted, status.Code(err))

	close(release)
	require.NoError(t, recv(t, done))
	res, err = c.Once(t.Context(), inbox, "msg-1", never)
	require.NoError(t, err)
	require.Equal(t, "first", string(res.Data))
}

func TestOnceWaitsForTheHolder(t *testing.T) {
	reg := inprocess.Start(t)
	release, done := blocking(t, reg.Client, "msg-1")
	waiter, obs := observedClient(t, reg)

	type result struct {
		res client.OnceResult
		err error
	}
	got := make(chan result, 1)
	go func() {
		res, err := waiter.Once(t.Context(), inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) {
			t.Error("the waiting duplicate ran")
			return nil, nil
		}, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond}))
		got <- result{res, err}
	}()
	obs.waitSent(t, "Claim", 2) // the registry holds the duplicate's second Claim
	close(release)
	require.NoError(t, recv(t, done))
	r := recv(t, got)
	require.NoError(t, r.err)
	require.True(t, r.res.Replayed)
	require.Equal(t, "first", string(r.res.Data))
	require.Equal(t, 1, obs.inProgressAnswers(), "the registry waited: the duplicate's first Claim, which asks for no wait so that it can share an RPC, is the one IN_PROGRESS answer; no polling")
}

func TestOnceWaitEndsWithTheContext(t *testing.T) {
	reg := inprocess.Start(t)
	release, done := blocking(t, reg.Client, "msg-1")
	defer func() { close(release); <-done }()
	ctx, cancel := context.WithCancel(t.Context())
	waiter, obs := observedClient(t, reg)
	go func() { obs.waitSent(t, "Claim", 1); cancel() }()
	_, err := waiter.Once(ctx, inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil },
		client.WithWaitInProgress(client.Backoff{}))
	require.ErrorIs(t, err, context.Canceled)
}

func TestOnceTakesOverACrashedHolder(t *testing.T) {
	t.Run("store clock moved past the lease", func(t *testing.T) {
		clock := &inprocess.Clock{}
		reg := inprocess.Start(t, inprocess.WithClock(clock.Now))
		c, ctx := reg.Client, t.Context()
		// A holder that claimed and died.
		crashed, err := c.Claim(ctx, client.ClaimParams{Key: msgKey, Lease: 30 * time.Second})
		require.NoError(t, err)
		_, err = c.Once(ctx, inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil })
		require.ErrorIs(t, err, client.ErrInProgress)

		clock.Advance(31 * time.Second)
		res, err := c.Once(ctx, inbox, "msg-1", func(_ context.Context, a client.Attempt) ([]byte, error) {
			require.EqualValues(t, 2, a.Attempt, "a takeover says an earlier attempt may have started the work")
			require.Greater(t, a.Token, crashed.Token)
			return nil, nil
		})
		require.NoError(t, err)
		require.True(t, res.Ran)
	})

	t.Run("waiting duplicate takes over when the lease runs out", func(t *testing.T) {
		reg := inprocess.Start(t, shortLeases())
		c, ctx := reg.Client, t.Context()
		_, err := c.Claim(ctx, client.ClaimParams{Key: msgKey, Lease: 50 * time.Millisecond})
		require.NoError(t, err)
		res, err := c.Once(ctx, inbox, "msg-1", func(_ context.Context, a client.Attempt) ([]byte, error) {
			require.EqualValues(t, 2, a.Attempt)
			return nil, nil
		}, client.WithWaitInProgress(client.Backoff{}))
		require.NoError(t, err)
		require.True(t, res.Ran)
	})
}

func TestOnceExtendsTheLease(t *testing.T) {
	reg := inprocess.Start(t, shortLeases())
	c, ctx := reg.Client, t.Context()
	const lease = 100 * time.Millisecond

	res, err := c.Once(ctx, inbox, "msg-1", func(ctx context.Context, a client.Attempt) ([]byte, error) {
		first, err := c.Lookup(ctx, a.Key)
		require.NoError(t, err)
		// Run well past the first lease: until it was extended three times.
		extensions, last := 0, first.LeaseExpiresAt
		eventually(t, func() bool {
			rec, err := c.Lookup(ctx, a.Key)
			require.NoError(t, err)
			if rec.LeaseExpiresAt.After(last) {
				extensions, last = extensions+1, rec.LeaseExpiresAt
			}
			return extensions >= 3
		}, "three lease extensions")
		// Still ours: a duplicate now is told to wait, not handed the key.
		dup, err := c.Claim(ctx, client.ClaimParams{Key: a.Key})
		require.NoError(t, err)
		require.Equal(t, client.OutcomeInProgress, dup.Outcome)
		require.Equal(t, a.Token, currentToken(t, reg, a.Key))
		return nil, nil
	}, client.WithLease(lease))
	require.NoError(t, err)
	require.True(t, res.Ran)
	require.EqualValues(t, 1, res.Record.Attempt)
}

// currentToken returns the record's current token, as an operator sees it.
func currentToken(t *testing.T, reg *inprocess.Registry, k client.Key) int64 {
	res, err := idemregv1.NewAdminServiceClient(reg.Conn).InspectRecord(t.Context(),
		&idemregv1.InspectRecordRequest{Consumer: k.Consumer, Kind: idemregv1.Kind(k.Kind), Key: k.Key})
	require.NoError(t, err)
	return res.GetRecord().GetToken()
}

func TestOnceLeaseLostCancelsTheHandler(t *testing.T) {
	clock := &inprocess.Clock{}
	reg := inprocess.Start(t, shortLeases(), inprocess.WithClock(clock.Now))
	c, ctx := reg.Client, t.Context()

	started := make(chan client.Attempt)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Once(ctx, inbox, "msg-1", func(ctx context.Context, a client.Attempt) ([]byte, error) {
			started <- a
			<-ctx.Done()
			assert.ErrorIs(t, context.Cause(ctx), client.ErrLeaseLost, "the cause says why")
			return nil, context.Cause(ctx)
		}, client.WithLease(100*time.Millisecond))
		errc <- err
	}()
	a := recv(t, started)
	// The holder stalls past its lease (by the store's clock) and another
	// consumer takes over; the next heartbeat learns it.
	clock.Advance(time.Minute)
	other, err := c.Claim(ctx, client.ClaimParams{Key: a.Key})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeAcquired, other.Outcome)
	err = recv(t, errc)
	require.ErrorIs(t, err, client.ErrLeaseLost)

	// The new holder's claim is untouched.
	_, err = c.Complete(ctx, a.Key, other.Fence(), client.ResponseResult("", nil))
	require.NoError(t, err)
}

func TestOnceRegistryDown(t *testing.T) {
	reg := inprocess.Start(t)
	require.NoError(t, reg.Stop())
	res, err := reg.Client.Once(t.Context(), inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) {
		t.Error("ran without the registry")
		return nil, nil
	})
	var ue *client.UnavailableError
	require.ErrorAs(t, err, &ue)
	require.False(t, res.Ran)
}

func TestOnceOutcomeNotRecorded(t *testing.T) {
	reg := inprocess.Start(t)
	res, err := reg.Client.Once(t.Context(), inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) {
		require.NoError(t, reg.StopStore()) // the registry's database goes down mid-handler
		return []byte("applied"), nil
	}, client.WithBookkeepingTimeout(100*time.Millisecond))
	require.True(t, res.Ran, "the caller learns the effect happened")
	require.ErrorIs(t, err, client.ErrUnavailable)
	require.ErrorContains(t, err, "not recorded")
}

// TestOnceRace: many deliveries of one message at once. The handler runs
// exactly once; every other delivery gets the replayed outcome (when it
// waits) or ErrInProgress (when it does not).
func TestOnceRace(t *testing.T) {
	reg := inprocess.Start(t)
	const n = 32
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			id := fmt.Sprintf("msg-race-%v", wait)
			var opts []client.OnceOption
			if wait {
				opts = append(opts, client.WithWaitInProgress(client.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond}))
			}
			var runs atomic.Int64
			var ran, replayed, inProgress atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for range n {
				wg.Go(func() {
					<-start
					res, err := reg.Client.Once(t.Context(), inbox, id, func(context.Context, client.Attempt) ([]byte, error) {
						runs.Add(1)
						return []byte("applied once"), nil
					}, opts...)
					switch {
					case errors.Is(err, client.ErrInProgress):
						inProgress.Add(1)
					case err != nil:
						t.Errorf("unexpected error: %v", err)
					case res.Ran:
						ran.Add(1)
					case res.Replayed:
						replayed.Add(1)
						assert.Equal(t, "applied once", string(res.Data))
					}
				})
			}
			close(start)
			wg.Wait()
			require.EqualValues(t, 1, runs.Load())
			require.EqualValues(t, 1, ran.Load())
			require.EqualValues(t, n-1, replayed.Load()+inProgress.Load())
			if wait {
				require.Zero(t, inProgress.Load(), "waiting duplicates all get the outcome")
			}
		})
	}
}

// TestOnceDeadlineDuringClaim: the caller's context ends while its Claim is
// in flight, after the registry acquired the key. The caller returns at
// once, and the claim it never learned of is released instead of blocking
// the key for a whole lease.
func TestOnceDeadlineDuringClaim(t *testing.T) {
	reg := inprocess.Start(t)
	c, sent, open := gatedClient(t, reg)
	defer open()
	// Should the caller wait for the answer (the bug this guards against),
	// it would wait forever: open the gate after the guard instead.
	time.AfterFunc(hangGuard, open)
	ctx, cancel := context.WithCancel(t.Context())
	go func() { <-sent; cancel() }()
	_, err := c.Once(ctx, inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) {
		t.Error("ran after its context ended")
		return nil, nil
	}, client.WithLease(time.Hour))
	require.ErrorIs(t, err, context.Canceled)

	open()
	eventually(t, func() bool {
		cl, err := reg.Client.Claim(t.Context(), client.ClaimParams{Key: msgKey})
		require.NoError(t, err)
		return cl.Outcome == client.OutcomeAcquired
	}, "the abandoned claim to be released")
}

func TestOnceZeroLeaseTakesTheDefault(t *testing.T) {
	reg := inprocess.Start(t)
	res, err := reg.Client.Once(t.Context(), inbox, "msg-1", func(context.Context, client.Attempt) ([]byte, error) { return nil, nil },
		client.WithLease(0), client.WithBookkeepingTimeout(0))
	require.NoError(t, err)
	require.True(t, res.Ran)
}

// TestOnceLeaseTotalCancelsTheHandler: when the registry refuses to extend
// because the attempt held the key for its max_lease_total, the handler's
// context is cancelled with that cause; the next attempt has a total of
// its own.
func TestOnceLeaseTotalCancelsTheHandler(t *testing.T) {
	clock := &inprocess.Clock{}
	l := inprocess.DefaultLimits()
	l.MinLease, l.DefaultLease, l.MaxLease, l.MaxLeaseTotal = 10*time.Millisecond, 100*time.Millisecond, time.Second, time.Second
	reg := inprocess.Start(t, inprocess.WithLimits(l), inprocess.WithClock(clock.Now))
	c, ctx := reg.Client, t.Context()

	started := make(chan client.Attempt)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Once(ctx, inbox, "msg-1", func(ctx context.Context, a client.Attempt) ([]byte, error) {
			started <- a
			<-ctx.Done()
			assert.ErrorIs(t, context.Cause(ctx), client.ErrLeaseTotalExceeded, "the cause says why")
			return nil, context.Cause(ctx)
		}, client.WithLease(100*time.Millisecond))
		errc <- err
	}()
	a := recv(t, started)
	// The store's clock passes the attempt's total; the next heartbeat is
	// refused.
	clock.Advance(time.Second)
	err := recv(t, errc)
	require.ErrorIs(t, err, client.ErrLeaseTotalExceeded)

	again, err := c.Claim(ctx, client.ClaimParams{Key: a.Key})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeAcquired, again.Outcome)
	require.EqualValues(t, 2, again.Record.Attempt, "the next attempt takes over, with a total of its own")
	_, err = c.Extend(ctx, a.Key, again.Fence(), 100*time.Millisecond)
	require.NoError(t, err)
}
