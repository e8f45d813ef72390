package client

import (
	"fmt"
	"testing"
	"time"
)

// TestInProgressRetryEstimate: an IN_PROGRESS answer suggests how long the
// consumer's work takes, not the time left on the holder's lease.
func TestInProgressRetryEstimate(t *testing.T) {
	var r runTimes
	lease := 29 * time.Second
	if got := r.retryAfter("c", lease); got != DefaultInProgressRetry {
		t.Fatalf("nothing seen: %v, want %v", got, DefaultInProgressRetry)
	}
	r.observe("c", 1500*time.Millisecond)
	if got := r.retryAfter("c", lease); got != 1500*time.Millisecond {
		t.Fatalf("one run of 1.5s: %v", got)
	}
	for range 50 {
		r.observe("c", 200*time.Millisecond)
	}
	if got := r.retryAfter("c", lease); got < 200*time.Millisecond || got > 210*time.Millisecond {
		t.Fatalf("runs of 200ms: %v", got)
	}
	if got := r.retryAfter("c", 80*time.Millisecond); got != 80*time.Millisecond {
		t.Fatalf("never past the lease: %v", got)
	}
	r.observe("fast", time.Microsecond)
	if got := r.retryAfter("fast", lease); got != MinInProgressRetry {
		t.Fatalf("fast work: %v, want the floor %v", got, MinInProgressRetry)
	}
	for i := range 2 * maxTimedConsumers {
		r.observe(fmt.Sprint("invented-", i), time.Millisecond)
	}
	if n := len(r.avg); n != maxTimedConsumers {
		t.Fatalf("%d consumers followed, want at most %d", n, maxTimedConsumers)
	}
}
