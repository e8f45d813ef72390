package storagetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Parking: a Claim that would take over a record whose attempts reached
// ClaimParams.MaxAttempts parks it, and the holder may park its own record
// with Park (storage.DecideClaim, storage.DecidePark).

var parkCases = []capabilityCase[storage.Store]{
	{"ParkAtMaxAttempts", testParkAtMaxAttempts},
	{"ParkMaxAttemptsUnbounded", testParkUnbounded},
	{"ParkedFingerprintMismatch", testParkedMismatch},
	{"Park", testPark},
	{"ParkErrors", testParkErrors},
	{"ParkedRefusesFencedCalls", testParkedRefusesFenced},
	{"ParkedAcrossExpiry", testParkedAcrossExpiry},
	{"RaceClaimsThatPark", testRaceClaimsThatPark},
	{"RaceParkVersusTakeover", testRaceParkVersusTakeover},
}

func atMost(p storage.ClaimParams, n int64) storage.ClaimParams {
	p.MaxAttempts = n
	return p
}

func park(t *testing.T, s storage.Store, k storage.Key, token int64, reason string) storage.Record {
	t.Helper()
	rec, err := s.Park(t.Context(), storage.ParkParams{Key: k, Token: token, Reason: reason})
	require.NoError(t, err)
	return rec
}

func requireParked(t *testing.T, res storage.ClaimResult, err error) storage.Record {
	t.Helper()
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeParked, res.Outcome)
	require.Equal(t, storage.StateParked, res.Record.State)
	return res.Record
}

// testParkAtMaxAttempts: attempts 1..N are acquisitions (N-1 takeovers),
// the claim that would make attempt N+1 parks the record as it is, and
// every later claim answers parked without a write.
func testParkAtMaxAttempts(t *testing.T, s storage.Store, c *Clock) {
	const maxAttempts = 3
	k := newKey(storage.KindOperation)
	var last storage.Record
	for attempt := int64(1); attempt <= maxAttempts; attempt++ {
		p := atMost(claimParams(k, "fp"), maxAttempts)
		p.Holder = fmt.Sprintf("holder-%d", attempt)
		last = acquire(t, s, p)
		require.Equal(t, attempt, last.Attempt)
		c.Advance(lease + time.Second)
	}
	before := c.Now().Add(-time.Minute)
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), maxAttempts))
	parked := requireParked(t, res, err)
	require.Equal(t, last.Token, parked.Token, "parking keeps the token")
	require.EqualValues(t, maxAttempts, parked.Attempt, "parking keeps the attempt")
	require.Equal(t, last.Holder, parked.Holder)
	require.Equal(t, "fp", string(parked.Fingerprint))
	require.Equal(t, storage.ParkReasonMaxAttempts, parked.ParkReason)
	require.True(t, parked.LeaseExpiresAt.Equal(last.LeaseExpiresAt), "the lease is not renewed")
	require.True(t, parked.ExpiresAt.After(before.Add(retention)), "kept for its retention from the parking")

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, parked, got)

	c.Advance(lease + time.Second)
	for _, p := range []storage.ClaimParams{atMost(claimParams(k, "fp"), maxAttempts), claimParams(k, ""), atMost(claimParams(k, "fp"), 100)} {
		res, err := s.Claim(t.Context(), p)
		requireSame(t, parked, requireParked(t, res, err))
	}
}

// testParkUnbounded: without MaxAttempts, takeovers go on as before.
func testParkUnbounded(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	for attempt := int64(1); attempt <= 4; attempt++ {
		require.Equal(t, attempt, acquire(t, s, claimParams(k, "fp")).Attempt)
		c.Advance(lease + time.Second)
	}
}

func testParkedMismatch(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	acquire(t, s, atMost(claimParams(k, "fp"), 1))
	c.Advance(lease + time.Second)
	_, err := s.Claim(t.Context(), atMost(claimParams(k, "other"), 1))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch, "a mismatch is refused before parking")
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	requireParked(t, res, err)
	_, err = s.Claim(t.Context(), claimParams(k, "other"))
	require.ErrorIs(t, err, storage.ErrFingerprintMismatch)
}

func testPark(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, "fp"))
	c.Advance(time.Second)
	before := c.Now().Add(-time.Minute)
	parked := park(t, s, k, rec.Token, "sent, no answer")
	require.Equal(t, storage.StateParked, parked.State)
	require.Equal(t, "sent, no answer", parked.ParkReason)
	require.Equal(t, rec.Token, parked.Token)
	require.Equal(t, rec.Attempt, parked.Attempt)
	require.True(t, parked.ExpiresAt.After(before.Add(retention)))

	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, parked, got)

	again := park(t, s, k, rec.Token, "another reason")
	requireSame(t, parked, again)
	require.Equal(t, "sent, no answer", again.ParkReason, "a repeated Park keeps the first reason")

	c.Advance(lease + time.Second) // the lease ran out: parked all the same
	res, err := s.Claim(t.Context(), claimParams(k, "fp"))
	requireSame(t, parked, requireParked(t, res, err))
}

func testParkErrors(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	_, err := s.Park(t.Context(), storage.ParkParams{Key: k, Token: 1, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrNotFound)

	first := acquire(t, s, claimParams(k, "fp"))
	c.Advance(lease + time.Second)
	second := acquire(t, s, claimParams(k, "fp"))
	_, err = s.Park(t.Context(), storage.ParkParams{Key: k, Token: first.Token, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "Park is fenced")

	complete(t, s, k, second.Token, "done")
	_, err = s.Park(t.Context(), storage.ParkParams{Key: k, Token: second.Token, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrAlreadyCompleted)
	res, err := s.Claim(t.Context(), claimParams(k, "fp"))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome, "a refused Park writes nothing")

	c.Advance(2 * retention)
	_, err = s.Park(t.Context(), storage.ParkParams{Key: k, Token: second.Token, Reason: "r"})
	require.ErrorIs(t, err, storage.ErrNotFound)
}

func testParkedRefusesFenced(t *testing.T, s storage.Store, _ *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, claimParams(k, "fp"))
	parked := park(t, s, k, rec.Token, "r")
	_, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrParked)
	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: k, Token: rec.Token})
	require.ErrorIs(t, err, storage.ErrParked)
	_, err = s.Extend(t.Context(), storage.ExtendParams{Key: k, Token: rec.Token, Lease: lease})
	require.ErrorIs(t, err, storage.ErrParked)
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: rec.Token + 1, Result: []byte("late")})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "the token is checked first")
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	requireSame(t, parked, got)
}

// testParkedAcrossExpiry: a parked record is parked until its retention
// from the parking has passed; then it counts as absent and the key
// starts afresh, with a larger token.
func testParkedAcrossExpiry(t *testing.T, s storage.Store, c *Clock) {
	k := newKey(storage.KindOperation)
	rec := acquire(t, s, atMost(claimParams(k, "fp"), 1))
	c.Advance(lease + time.Second)
	res, err := s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	parked := requireParked(t, res, err)

	c.Advance(retention - time.Minute) // before the retention from the parking ends
	res, err = s.Claim(t.Context(), atMost(claimParams(k, "fp"), 1))
	requireParked(t, res, err)

	c.Advance(2 * time.Minute)
	_, err = s.Lookup(t.Context(), k)
	require.ErrorIs(t, err, storage.ErrNotFound, "expired")
	fresh := acquire(t, s, atMost(claimParams(k, "other"), 1))
	require.EqualValues(t, 1, fresh.Attempt)
	require.Equal(t, storage.StateInProgress, fresh.State)
	require.Empty(t, fresh.ParkReason)
	require.Greater(t, fresh.Token, parked.Token)
	require.Greater(t, fresh.Token, rec.Token)
}

// testRaceClaimsThatPark races Claims at a record whose attempts ran out:
// every one answers parked, nobody acquires, and the record is the one
// parked record.
func testRaceClaimsThatPark(t *testing.T, s storage.Store, c *Clock) {
	for range 4 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, atMost(claimParams(k, "fp"), 1))
		c.Advance(lease + time.Second)
		answers := raceClaims(s, 32, func(i int) storage.ClaimParams {
			p := atMost(claimParams(k, "fp"), 1)
			p.Holder = fmt.Sprintf("holder-%d", i)
			return p
		})
		for _, a := range answers {
			rec := requireParked(t, a.res, a.err)
			require.Equal(t, first.Token, rec.Token)
			require.Equal(t, first.Holder, rec.Holder)
			require.Equal(t, answers[0].res.Record.ExpiresAt, rec.ExpiresAt, "parked once")
		}
	}
}

// testRaceParkVersusTakeover races the holder's Park, after its lease ran
// out, against takeovers: either the Park wins and every Claim answers
// parked, or one takeover wins and the Park is LEASE_LOST.
func testRaceParkVersusTakeover(t *testing.T, s storage.Store, c *Clock) {
	for range 4 {
		k := newKey(storage.KindOperation)
		first := acquire(t, s, claimParams(k, "fp"))
		c.Advance(lease + time.Second)
		type result struct {
			claim claimAnswer
			park  error
		}
		results := parallel(17, func(i int) result {
			if i == 0 {
				_, err := s.Park(context.Background(), storage.ParkParams{Key: k, Token: first.Token, Reason: "r"})
				return result{park: err}
			}
			p := claimParams(k, "fp")
			p.Holder = fmt.Sprintf("holder-%d", i)
			res, err := s.Claim(context.Background(), p)
			return result{claim: claimAnswer{res, err}}
		})
		acquired, parked := 0, 0
		for _, r := range results[1:] {
			require.NoError(t, r.claim.err)
			switch r.claim.res.Outcome {
			case storage.OutcomeAcquired:
				acquired++
			case storage.OutcomeParked:
				parked++
			default:
				require.Equal(t, storage.OutcomeInProgress, r.claim.res.Outcome)
			}
		}
		if results[0].park == nil {
			require.Zero(t, acquired, "the Park won: nobody acquires")
			require.Equal(t, 16, parked)
		} else {
			require.ErrorIs(t, results[0].park, storage.ErrLeaseLost)
			require.Equal(t, 1, acquired, "a takeover won: exactly one")
			require.Zero(t, parked)
		}
	}
}
