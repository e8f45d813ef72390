package storagetest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Races: calls of every kind on one key from many goroutines, whose
// answers must agree with one order of the calls.

func parallel[T any](n int, fn func(i int) T) []T {
	out := make([]T, n)
	var start, done sync.WaitGroup
	start.Add(1)
	for i := range n {
		done.Go(func() {
			start.Wait()
			out[i] = fn(i)
		})
	}
	start.Done()
	done.Wait()
	return out
}

type claimAnswer struct {
	res storage.ClaimResult
	err error
}

// raceClaims runs n Claims at once, the i-th with params(i).
func raceClaims(s storage.Store, n int, params func(i int) storage.ClaimParams) []claimAnswer {
	return parallel(n, func(i int) claimAnswer {
		res, err := s.Claim(context.Background(), params(i))
		return claimAnswer{res, err}
	})
}

func testRaceClaimNewKey(t *testing.T, s storage.Store, _ *Clock) {
	for range 5 {
		k := newKey(storage.KindMessage)
		answers := raceClaims(s, 64, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.Holder = fmt.Sprintf("holder-%d", i)
			return p
		})
		var winner *storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				require.Nil(t, winner, "two callers acquired one key")
				winner = &a.res.Record
			}
		}
		require.NotNil(t, winner, "nobody acquired")
		for _, a := range answers {
			if a.res.Outcome != storage.OutcomeAcquired {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.Equal(t, winner.Token, a.res.Record.Token)
				require.Equal(t, winner.Holder, a.res.Record.Holder)
			}
		}
	}
}

// testRaceRepeatedRequestID races repeats of one Claim (the same request
// id, as a client retrying after a lost reply would send) against Claims
// with ids of their own: one claim wins, and whoever sees ACQUIRED holds the
// winner's token with the winner's id; nobody else does.
func testRaceRepeatedRequestID(t *testing.T, s storage.Store, _ *Clock) {
	idOf := func(i int) string {
		if i%2 == 0 {
			return "repeated"
		}
		return fmt.Sprintf("own-%d", i)
	}
	for round := range 6 {
		k := newKey(storage.KindMessage)
		answers := raceClaims(s, 32, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.RequestID = idOf(i)
			return p
		})
		var winner *storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				if winner == nil {
					winner = &a.res.Record
				}
				require.Equal(t, winner.Token, a.res.Record.Token, "two tokens acquired for one key")
			}
		}
		require.NotNil(t, winner, "nobody acquired (round %d)", round)
		for i, a := range answers {
			id := idOf(i)
			require.Equal(t, winner.Token, a.res.Record.Token)
			if a.res.Outcome == storage.OutcomeAcquired {
				require.Equal(t, winner.RequestID, id, "caller %d got a token its request id did not win", i)
			} else {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.NotEqual(t, winner.RequestID, id, "caller %d repeated the winning claim and was refused", i)
			}
		}
	}
}

func testRaceTakeover(t *testing.T, s storage.Store, c *Clock) {
	for range 5 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		answers := raceClaims(s, 32, func(i int) storage.ClaimParams {
			p := claimParams(k, "fp")
			p.Holder = fmt.Sprintf("holder-%d", i)
			return p
		})
		acquired := 0
		var winner storage.Record
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				acquired++
				winner = a.res.Record
			}
		}
		require.Equal(t, 1, acquired, "exactly one takeover wins")
		require.Greater(t, winner.Token, first.Token)
		require.EqualValues(t, 2, winner.Attempt)
		for _, a := range answers {
			if a.res.Outcome != storage.OutcomeAcquired {
				require.Equal(t, storage.OutcomeInProgress, a.res.Outcome)
				require.Equal(t, winner.Token, a.res.Record.Token)
			}
		}
	}
}

// testRaceCompleteVersusTakeover races a late Complete by the holder of an
// expired lease against takeovers: either the Complete is accepted and the
// takeovers replay it, or one takeover wins and the Complete is LEASE_LOST.
func testRaceCompleteVersusTakeover(t *testing.T, s storage.Store, c *Clock) {
	completedFirst, takenFirst := 0, 0
	for range 20 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)

		var completeErr error
		answers := parallel(9, func(i int) claimAnswer {
			if i == 0 {
				_, completeErr = s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: first.Token, Result: []byte("zombie")})
				return claimAnswer{}
			}
			res, err := s.Claim(context.Background(), claimParams(k, "fp"))
			return claimAnswer{res, err}
		})[1:]

		acquired := 0
		for _, a := range answers {
			require.NoError(t, a.err)
			if a.res.Outcome == storage.OutcomeAcquired {
				acquired++
			}
		}
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		if completeErr == nil {
			completedFirst++
			require.Zero(t, acquired, "a takeover won after the Complete was accepted")
			require.Equal(t, storage.StateCompleted, got.State)
			require.Equal(t, first.Token, got.Token)
			require.Equal(t, "zombie", string(got.Result))
			for _, a := range answers {
				require.Equal(t, storage.OutcomeCompleted, a.res.Outcome)
			}
		} else {
			takenFirst++
			require.ErrorIs(t, completeErr, storage.ErrLeaseLost)
			require.Equal(t, 1, acquired, "exactly one takeover wins")
			require.Equal(t, storage.StateInProgress, got.State)
			require.Greater(t, got.Token, first.Token)
		}
	}
	t.Logf("complete won %d times, takeover won %d times", completedFirst, takenFirst)
}

// testRaceFenced races Complete, Release and Extend by a stale and a current
// holder: the stale one always loses and the current one always wins.
func testRaceFenced(t *testing.T, s storage.Store, c *Clock) {
	for range 10 {
		k := newKey(storage.KindOperation)
		stale := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		current := acquire(t, s, claimParams(k, "fp"))

		errs := parallel(8, func(i int) error {
			token := stale.Token
			if i%2 == 1 {
				token = current.Token
			}
			var err error
			switch i / 2 {
			case 0, 1:
				_, err = s.Extend(context.Background(), storage.ExtendParams{Key: k, Token: token, Lease: lease})
			case 2:
				_, err = s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: token, Result: fmt.Appendf(nil, "from-%d", token)})
			case 3:
				_, err = s.Release(context.Background(), storage.ReleaseParams{Key: k, Token: token})
			}
			return err
		})
		for i, err := range errs {
			if i%2 == 0 {
				require.ErrorIs(t, err, storage.ErrLeaseLost, "stale operation %d", i)
			} else if err != nil {
				// The current holder's Complete, Release and Extends race
				// each other: a Release or Extend after the Complete finds
				// the record completed.
				require.ErrorIs(t, err, storage.ErrAlreadyCompleted, "current operation %d", i)
			}
		}
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, current.Token, got.Token)
		require.Equal(t, storage.StateCompleted, got.State)
		require.Equal(t, fmt.Sprintf("from-%d", current.Token), string(got.Result))
	}
}

// testRaceManyKeys runs claim/complete/release cycles from many goroutines
// over a few keys and checks that no token of a key is issued twice and that
// a key is completed only by the holder of its last token.
func testRaceManyKeys(t *testing.T, s storage.Store, _ *Clock) {
	keys := []storage.Key{newKey(storage.KindMessage), newKey(storage.KindMessage), newKey(storage.KindMessage)}
	var mu sync.Mutex
	type keyToken struct {
		key   storage.Key
		token int64
	}
	issued := map[keyToken]bool{}
	completedBy := map[storage.Key]int64{}
	errs := parallel(16, func(i int) error {
		for n := range 15 {
			k := keys[(i+n)%len(keys)]
			p := claimParams(k, "")
			p.Lease = time.Minute
			res, err := s.Claim(context.Background(), p)
			if err != nil {
				return err
			}
			if res.Outcome != storage.OutcomeAcquired {
				continue
			}
			mu.Lock()
			kt := keyToken{k, res.Record.Token}
			dup := issued[kt]
			issued[kt] = true
			mu.Unlock()
			if dup {
				return fmt.Errorf("token %d issued twice", res.Record.Token)
			}
			if n%3 == 0 {
				if _, err := s.Release(context.Background(), storage.ReleaseParams{Key: k, Token: res.Record.Token}); err != nil {
					return err
				}
				continue
			}
			if _, err := s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")}); err != nil {
				return err
			}
			mu.Lock()
			prev, seen := completedBy[k]
			completedBy[k] = res.Record.Token
			mu.Unlock()
			if seen && prev != res.Record.Token {
				return fmt.Errorf("key %s completed by tokens %d and %d", k.Key, prev, res.Record.Token)
			}
		}
		return nil
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.NotEmpty(t, issued)
	for k, token := range completedBy {
		got, err := s.Lookup(t.Context(), k)
		require.NoError(t, err)
		require.Equal(t, token, got.Token)
		require.Equal(t, storage.StateCompleted, got.State)
	}
}
