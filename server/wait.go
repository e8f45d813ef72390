package server

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/quota"
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
// and its sleep still wakes it. A replica keeps at most MaxWaiters, and each
// identity of the config file at most its share of them
// (MaxWaitersPerIdentity, like the share of the store's slots in
// observe.go), so that one tenant's waits (each a goroutine, a timer and
// its request, held for up to MaxWait) cannot take every slot, or the
// memory and re-checks they cost, from the others; a Claim beyond either
// answers at once. Server.Serve ends every wait when it starts to shut
// down.

// Bounds of waiting.
const (
	// MaxWait is the longest wait a Claim may ask for.
	MaxWait = 30 * time.Second
	// DefaultMaxWaiters is how many Claims may wait at once on a replica.
	DefaultMaxWaiters = 10000
	// DefaultWaitShare is the share of MaxWaiters one identity may hold by
	// default: half, as for the store's slots (DefaultInFlightShare), so
	// that a tenant holding every wait it may still leaves half to the
	// others.
	DefaultWaitShare = 0.5
	// DefaultWaitRecheck is how often a waiter looks at the record for
	// changes made through other replicas.
	DefaultWaitRecheck = 100 * time.Millisecond
)

// The bounds that refuse a wait, the values of the "bound" attribute of
// idemreg.waits.refused.
const (
	waitBoundServer   = "server"   // the replica had MaxWaiters waiting
	waitBoundIdentity = "identity" // the identity had its share of them
)

// waitHub wakes the Claims waiting on a key when this replica changes it.
type waitHub struct {
	mu   sync.Mutex
	keys map[storage.Key]*waitKey
	n    int // waiters registered
	max  int
	// perIdentity bounds the waiters of each identity, counted in
	// byIdentity; zero when an identity may take every slot. Names come
	// from the config file, so the map stays as small as its identities.
	perIdentity int
	byIdentity  map[string]int
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

// newWaitHub keeps at most maxWaiters, and perIdentity of each identity
// when it is less.
func newWaitHub(maxWaiters, perIdentity int) *waitHub {
	h := &waitHub{keys: map[storage.Key]*waitKey{}, max: maxWaiters, draining: make(chan struct{})}
	if perIdentity < maxWaiters {
		h.perIdentity, h.byIdentity = perIdentity, map[string]int{}
	}
	return h
}

// join registers a waiter on k for identity (empty: a caller with no
// share of its own); it returns the bound that refused it instead, if one
// did.
func (h *waitHub) join(k storage.Key, identity string) (*waitKey, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n >= h.max {
		return nil, waitBoundServer
	}
	shared := h.byIdentity != nil && identity != ""
	if shared && h.byIdentity[identity] >= h.perIdentity {
		return nil, waitBoundIdentity
	}
	w := h.keys[k]
	if w == nil {
		w = &waitKey{changed: make(chan struct{})}
		h.keys[k] = w
	}
	w.refs++
	h.n++
	if shared {
		h.byIdentity[identity]++
	}
	return w, ""
}

func (h *waitHub) leave(k storage.Key, w *waitKey, identity string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	w.refs--
	h.n--
	if h.byIdentity != nil && identity != "" {
		if h.byIdentity[identity]--; h.byIdentity[identity] == 0 {
			delete(h.byIdentity, identity)
		}
	}
	if w.refs == 0 && h.keys[k] == w {
		delete(h.keys, k)
	}
}

// waitShare is the name whose share of the waiters the request of ctx
// takes: its identity's, none (empty) for the anonymous caller of an open
// server, which is every caller and not a tenant.
func waitShare(ctx context.Context) string {
	if id, ok := IdentityFrom(ctx); ok && id != nil && id != access.Anonymous {
		return id.Name
	}
	return ""
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

// claim decides p, waiting up to wait while the key is in progress; r,
// what its admission reserved of the consumer's quota, is settled by
// every decision.
func (s *Service) claim(ctx context.Context, p storage.ClaimParams, wait time.Duration, r *quota.Reservation) (storage.ClaimResult, error) {
	if wait <= 0 {
		res, err := s.store.Claim(ctx, p)
		s.quotas.Claimed(r, res, err)
		return res, err
	}
	start := time.Now()
	end := waitEnd(ctx, wait)
	res, err, ended := s.waitClaim(ctx, p, end, s.decideJoined(ctx, p, r), r)
	if ended != "" {
		d := attrs(attribute.String("ended", ended))
		s.metrics.waits.Add(ctx, 1, d)
		s.metrics.waitDuration.Record(ctx, time.Since(start).Seconds(), d)
	}
	return res, err
}

// decision is a Claim decided while registered as a waiter on its key
// (unless a bound refused it), so that no change after it is missed.
type decision struct {
	w *waitKey
	// refused is the bound that kept the Claim from waiting, if any.
	refused string
	res     storage.ClaimResult
	err     error
}

// joinWait registers a waiter on p's key for the caller of ctx.
func (s *Service) joinWait(ctx context.Context, k storage.Key) decision {
	w, refused := s.waiters.join(k, waitShare(ctx))
	return decision{w: w, refused: refused}
}

func (s *Service) decideJoined(ctx context.Context, p storage.ClaimParams, r *quota.Reservation) decision {
	d := s.joinWait(ctx, p.Key)
	d.res, d.err = s.store.Claim(ctx, p)
	s.quotas.Claimed(r, d.res, d.err)
	return d
}

// waitClaim is claim's loop from the first decision d (whose answer r
// already settled); ended says how a wait ended, empty when the first
// decision needed none.
func (s *Service) waitClaim(ctx context.Context, p storage.ClaimParams, end time.Time, d decision, r *quota.Reservation) (res storage.ClaimResult, err error, ended string) {
	share := waitShare(ctx)
	for round := 0; ; round++ {
		if round > 0 {
			d = s.decideJoined(ctx, p, r)
		}
		w, joined := d.w, d.refused == ""
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
			refused := []attribute.KeyValue{attribute.String("bound", d.refused)}
			if d.refused == waitBoundIdentity {
				refused = append(refused, attribute.String("identity", share))
			}
			s.metrics.waitsRefused.Add(ctx, 1, attrs(refused...))
		case !time.Now().Before(end):
			ended = WaitElapsed
		}
		if ended != "" {
			if joined {
				s.waiters.leave(p.Key, w, share)
			}
			if round == 0 && ended != WaitFull {
				ended = "" // answered at once: no wait
			}
			return res, err, ended
		}
		decided := time.Now()
		ended = s.sleep(ctx, p.Key, w, res, end)
		s.waiters.leave(p.Key, w, share)
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
