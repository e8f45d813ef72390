package client

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"
)

// DefaultBackoff is the backoff of WithWaitInProgress when its fields are
// zero: 50ms doubling up to 1s, with ±20% jitter, never past the holder's
// lease. The client's own repeats (a Claim whose answer was lost, a
// Complete the registry could not take) follow it too.
var DefaultBackoff = Backoff{Initial: 50 * time.Millisecond, Max: time.Second}

// Backoff is the schedule of Claims while waiting for another holder.
type Backoff struct {
	// Initial is the first delay; each next one doubles, up to Max.
	Initial, Max time.Duration
}

func (b Backoff) withDefaults() Backoff {
	if b.Initial <= 0 {
		b.Initial = DefaultBackoff.Initial
	}
	if b.Max <= 0 {
		b.Max = max(DefaultBackoff.Max, b.Initial)
	}
	return b
}

// backoff spaces the attempts of one loop of the client: every repeated
// Claim, BatchClaim, Complete and BatchComplete, and every Claim of a wait
// for another holder, sleeps through it and nothing else, so that each
// delay is jittered and none outlives the caller's context.
type backoff struct {
	delay, max time.Duration
}

func newBackoff(b Backoff) *backoff { return &backoff{delay: b.Initial, max: b.Max} }

// wait sleeps before the next attempt (next's delay) and reports whether
// it may be made: it returns false, without sleeping on, as soon as ctx
// ends, so that no sleep runs past the caller's deadline or cancellation.
func (b *backoff) wait(ctx context.Context, floor, ceiling time.Duration) bool {
	d := b.next(floor, ceiling)
	if ctx.Err() != nil {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// next is the sleep before the next attempt: the current delay spread by
// ±20% (so that callers that failed together do not come back together),
// raised to floor when that is longer (the registry's RetryInfo: it knows
// better when it can take the call) and then lowered to ceiling when that
// is positive and shorter (the holder's lease: from its end the key can be
// taken over; or what is left of a bounded wait). The delay after it
// doubles, up to the schedule's Max.
func (b *backoff) next(floor, ceiling time.Duration) time.Duration {
	d := max(jitter(b.delay), floor)
	if ceiling > 0 {
		d = min(d, ceiling)
	}
	b.delay = min(2*b.delay, b.max)
	return d
}

// retryInfo is the RetryInfo of an *UnavailableError in err: the least a
// repeat should wait; zero for any other error.
func retryInfo(err error) time.Duration {
	if ue := (*UnavailableError)(nil); errors.As(err, &ue) {
		return ue.RetryAfter
	}
	return 0
}

// jitter spreads d by ±20%.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
