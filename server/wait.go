package server

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemreg/idemreg/storage"
)

// Waiting.
//
// A Claim with a wait, finding the key in progress under another holder's
// live lease, does not answer OUTCOME_IN_PROGRESS at once: it waits for a
// reason to decide again, and decides again with the same Claim, so the
// store decides every outcome exactly as without waiting. The reasons:
//   - a Complete, Release, BatchComplete or InvalidateRecord of the key
//     through this replica (waitHub.notify), at once;
//   - the holder's lease running out (the Claim's RetryAfter), without
//     anyone writing;
//   - a re-check every WaitRecheck (DefaultWaitRecheck), for changes made
//     through other replicas: a Lookup, and a Claim when the Lookup shows
//     the record completed, released or gone;
//   - the wait, or the request's deadline less a margin, running out: the
//     answer is then OUTCOME_IN_PROGRESS as without waiting.
//
// A waiter registers before it decides, so a change between its decision
// and its sleep still wakes it. A replica keeps at most MaxWaiters; a Claim
// beyond that answers at once. Server.Serve ends every wait when it starts
// to shut down.

// Bounds of waiting.
const (
	// MaxWait is the longest wait a Claim may ask for.
	MaxWait = 30 * time.Second
	// DefaultMaxWaiters is how many Claims may wait at once on a replica.
	DefaultMaxWaiters = 10000
	// DefaultWaitRecheck is how often a waiter looks at the record for
	// changes made through other replicas.
	DefaultWaitRecheck = 100 * time.Millisecond
)

// waitHub wakes the Claims waiting on a key when this replica changes it.
type waitHub struct {
	mu   sync.Mutex
	keys map[storage.Key]*waitKey
	n    int // waiters registered
	max  int
	// asleep counts the Claims in sleep: registered, and decided once
	// with the key in progress. A registered Claim may still be making
	// its first decision, which can answer at once without a wait.
	asleep atomic.Int64
	// draining is closed when the server shuts down.
	draining  chan struct{}
	drainOnce sync.Once
}

type waitKey struct {
	changed chan struct{} // closed by notify
	refs    int
}

func newWaitHub(maxWaiters int) *waitHub {
	return &waitHub{keys: map[storage.Key]*waitKey{}, max: maxWaiters, draining: make(chan struct{})}
}

// join registers a waiter on k; false when the replica has max waiters.
func (h *waitHub) join(k storage.Key) (*waitKey, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n >= h.max {
		return nil, false
	}
	w := h.keys[k]
	if w == nil {
		w = &waitKey{changed: make(chan struct{})}
		h.keys[k] = w
	}
	w.refs++
	h.n++
	return w, true
}

func (h *waitHub) leave(k storage.Key, w *waitKey) {
	h.mu.Lock()
	defer h.mu.Unlock()
	w.refs--
	h.n--
	if w.refs == 0 && h.keys[k] == w {
		delete(h.keys, k)
	}
}

// notify wakes every waiter on k.
func (h *waitHub) notify(k storage.Key) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if w := h.keys[k]; w != nil {
		close(w.changed)
		delete(h.keys, k)
	}
}

// waiting reports how many Claims wait asleep for a change of their key.
func (h *waitHub) waiting() int { return int(h.asleep.Load()) }

// drain ends every wait, now and to come.
func (h *waitHub) drain() { h.drainOnce.Do(func() { close(h.draining) }) }

// waitEnd is when a wait of d that starts now must answer: at d, and no
// later than a tenth of the request's time before its deadline, so that
// the answer reaches the caller before the deadline does.
func waitEnd(ctx context.Context, d time.Duration) time.Time {
	now := time.Now()
	end := now.Add(d)
	if dl, ok := ctx.Deadline(); ok {
		margin := min(max(dl.Sub(now)/10, minDeadlineMargin), maxDeadlineMargin)
		if byDeadline := dl.Add(-margin); byDeadline.Before(end) {
			end = byDeadline
		}
	}
	return end
}

// claim decides p, waiting up to wait while the key is in progress.
func (s *Service) claim(ctx context.Context, p storage.ClaimParams, wait time.Duration) (storage.ClaimResult, error) {
	if wait <= 0 {
		return s.store.Claim(ctx, p)
	}
	start := time.Now()
	end := waitEnd(ctx, wait)
	res, err, ended := s.waitClaim(ctx, p, end, s.decideJoined(ctx, p))
	if ended != "" {
		d := attrs(attribute.String("ended", ended))
		s.metrics.waits.Add(ctx, 1, d)
		s.metrics.waitDuration.Record(ctx, time.Since(start).Seconds(), d)
	}
	return res, err
}

// decision is a Claim decided while registered as a waiter on its key
// (unless the replica had too many), so that no change after it is missed.
type decision struct {
	w      *waitKey
	joined bool
	res    storage.ClaimResult
	err    error
}

func (s *Service) decideJoined(ctx context.Context, p storage.ClaimParams) decision {
	w, joined := s.waiters.join(p.Key)
	res, err := s.store.Claim(ctx, p)
	return decision{w: w, joined: joined, res: res, err: err}
}

// waitClaim is claim's loop from the first decision d; ended says how a
// wait ended, empty when the first decision needed none.
func (s *Service) waitClaim(ctx context.Context, p storage.ClaimParams, end time.Time, d decision) (res storage.ClaimResult, err error, ended string) {
	for round := 0; ; round++ {
		if round > 0 {
			d = s.decideJoined(ctx, p)
		}
		w, joined := d.w, d.joined
		res, err = d.res, d.err
		switch {
		case err != nil:
			ended = WaitError
		case res.Outcome == storage.OutcomeCompleted:
			ended = WaitCompleted
		case res.Outcome == storage.OutcomeAcquired:
			ended = WaitAcquired
		case res.Outcome == storage.OutcomeParked:
			ended = WaitParked // nobody holds it: nothing to wait for
		case !joined:
			ended = WaitFull
		case !time.Now().Before(end):
			ended = WaitElapsed
		}
		if ended != "" {
			if joined {
				s.waiters.leave(p.Key, w)
			}
			if round == 0 && ended != WaitFull {
				ended = "" // answered at once: no wait
			}
			return res, err, ended
		}
		decided := time.Now()
		ended = s.sleep(ctx, p.Key, w, res, end)
		s.waiters.leave(p.Key, w)
		if ended != "" {
			res.RetryAfter = max(res.RetryAfter-time.Since(decided), 0)
			return res, err, ended
		}
	}
}

// sleep waits on w until a reason to decide again (it returns "") or the
// end of the wait (it returns how it ended).
func (s *Service) sleep(ctx context.Context, k storage.Key, w *waitKey, res storage.ClaimResult, end time.Time) string {
	s.waiters.asleep.Add(1)
	defer s.waiters.asleep.Add(-1)
	leaseEnd := time.Now().Add(res.RetryAfter)
	for {
		d := min(time.Until(leaseEnd), time.Until(end), s.recheck)
		timer := time.NewTimer(max(d, 0))
		select {
		case <-w.changed:
			timer.Stop()
			return ""
		case <-ctx.Done():
			timer.Stop()
			return WaitCanceled
		case <-s.waiters.draining:
			timer.Stop()
			return WaitDrained
		case <-timer.C:
		}
		now := time.Now()
		switch {
		case !now.Before(leaseEnd):
			return "" // the lease may have ended: decide again
		case !now.Before(end):
			return WaitElapsed
		}
		// A re-check for changes made through other replicas: a read,
		// and a Claim only when it shows another state.
		rec, err := s.store.Lookup(ctx, k)
		if err != nil || rec.State != storage.StateInProgress || rec.Token != res.Record.Token || !rec.LeaseExpiresAt.Equal(res.Record.LeaseExpiresAt) {
			return ""
		}
	}
}
