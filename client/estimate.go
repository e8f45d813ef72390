package client

import (
	"sync"
	"time"
)

// maxTimedConsumers bounds how many consumers runTimes follows: a client
// serves a handful (one per intercepted method, one per message consumer),
// and a caller that invents consumer names must not grow it without end.
const maxTimedConsumers = 1024

// runTimes is what an IN_PROGRESS answer's RetryInfo is estimated from:
// per consumer, a moving average (weight 1/8 for each new run) of how long
// the work this client ran under a claim took, from the claim to its
// outcome. The registry's own RetryAfter is the time left on the holder's
// lease, which a heartbeat keeps between half a lease and a lease whatever
// the work's length (30 s for a call that takes 1.5 s): a duplicate told
// that would come back long after the answer is in. The replicas of a
// service run the same work, so what this one saw is a fair guess at the
// holder's time.
type runTimes struct {
	mu  sync.RWMutex
	avg map[string]time.Duration
}

func (r *runTimes) observe(consumer string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old, ok := r.avg[consumer]
	switch {
	case ok:
		r.avg[consumer] = old + (d-old)/8
	case len(r.avg) < maxTimedConsumers:
		if r.avg == nil {
			r.avg = make(map[string]time.Duration)
		}
		r.avg[consumer] = d
	}
}

// retryAfter is the delay an IN_PROGRESS answer suggests: the consumer's
// average run, or DefaultInProgressRetry before any was seen, at least
// MinInProgressRetry, and never past the holder's lease (leaseLeft, when
// known): from then on the key can be taken over.
func (r *runTimes) retryAfter(consumer string, leaseLeft time.Duration) time.Duration {
	r.mu.RLock()
	d, ok := r.avg[consumer]
	r.mu.RUnlock()
	if !ok {
		d = DefaultInProgressRetry
	}
	d = max(d, MinInProgressRetry)
	if leaseLeft > 0 {
		d = min(d, leaseLeft)
	}
	return d
}
