package client

import (
	"context"
	"testing"
	"time"
)

// TestBackoffNext: each delay is the schedule's, doubling up to Max, spread
// by ±20%; RetryInfo raises it and the holder's lease (or a wait's bound)
// lowers it.
func TestBackoffNext(t *testing.T) {
	within := func(t *testing.T, got, want time.Duration) {
		t.Helper()
		if lo, hi := want*8/10, want*12/10; got < lo || got > hi {
			t.Fatalf("delay %v, want %v ±20%% [%v, %v]", got, want, lo, hi)
		}
	}
	tests := []struct {
		name           string
		floor, ceiling time.Duration
		want           []time.Duration // before jitter, unless exact
		exact          bool
	}{
		{name: "doubling up to Max", want: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second}},
		{name: "RetryInfo longer than the delay", floor: 3 * time.Second, want: []time.Duration{3 * time.Second, 3 * time.Second}, exact: true},
		{name: "RetryInfo shorter than the delay", floor: time.Millisecond, want: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond}},
		{name: "lease shorter than the delay", ceiling: 7 * time.Millisecond, want: []time.Duration{7 * time.Millisecond, 7 * time.Millisecond}, exact: true},
		{name: "ceiling over floor", floor: time.Second, ceiling: 30 * time.Millisecond, want: []time.Duration{30 * time.Millisecond}, exact: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newBackoff(DefaultBackoff)
			for i, want := range tt.want {
				got := b.next(tt.floor, tt.ceiling)
				if tt.exact {
					if got != want {
						t.Fatalf("delay %d: %v, want %v", i, got, want)
					}
					continue
				}
				within(t, got, want)
			}
		})
	}
	// Jitter spreads callers that failed together.
	seen := map[time.Duration]bool{}
	for range 20 {
		seen[newBackoff(DefaultBackoff).next(0, 0)] = true
	}
	if len(seen) < 2 {
		t.Fatalf("20 first delays all %v: no jitter", seen)
	}
}

// TestBackoffWaitEndsWithContext: a wait never outlasts its context: it
// returns false at once for an ended context, and at the deadline for a
// delay (here an hour) longer than what is left of it.
func TestBackoffWaitEndsWithContext(t *testing.T) {
	slow := Backoff{Initial: time.Hour, Max: time.Hour}

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if newBackoff(slow).wait(ctx, 0, 0) {
		t.Fatal("wait on an ended context reported that the next attempt may be made")
	}

	ctx, cancel = context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if newBackoff(slow).wait(ctx, 0, 0) {
		t.Fatal("wait past the deadline reported that the next attempt may be made")
	}
	if ctx.Err() == nil {
		t.Fatal("wait returned before the deadline")
	}

	if !newBackoff(Backoff{Initial: time.Millisecond, Max: time.Millisecond}).wait(t.Context(), 0, 0) {
		t.Fatal("a wait within the context reported that the next attempt may not be made")
	}
}
