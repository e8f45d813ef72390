// Package waiting holds the Claims that wait for a key in progress to
// change.
//
// A Claim with a wait, finding the key in progress under another holder's
// live lease, does not answer OUTCOME_IN_PROGRESS at once: it waits for a
// reason to decide again, and decides again with the same Claim, so the
// store decides every outcome exactly as without waiting. The reasons:
//   - a Complete, Release, BatchComplete or InvalidateRecord of the key
//     through this replica (Hub.Notify), at once;
//   - the holder's lease running out (the Claim's RetryAfter), without
//     anyone writing;
//   - a change through another replica that tells this one (Hub.Notify
//     from server/internal/peers), at once: a waiting Claim marks the
//     record with its replica (Claim.Mark) before it sleeps, and the
//     statement that ends the attempt returns the marks to the replica
//     that ran it;
//   - a re-check every Claim.Recheck, for changes made through other
//     replicas that did not tell (unreachable, or a store without marks):
//     a Lookup, and a Claim when the Lookup shows the record completed,
//     released or gone;
//   - the wait, or the request's deadline less a margin, running out: the
//     answer is then OUTCOME_IN_PROGRESS as without waiting.
//
// A waiter registers before it decides, so a change between its decision
// and its sleep still wakes it. A replica keeps at most its maximum of
// waiters, and each identity of the config file at most its share of them
// (like the share of the store's slots), so that one tenant's waits (each
// a goroutine, a timer and its request, held for up to the longest wait)
// cannot take every slot, or the memory and re-checks they cost, from the
// others; a Claim beyond either answers at once. Hub.Drain ends every wait
// (the server ends them when it starts to shut down).
//
// The package decides nothing: Claim runs the decision it is given (the
// store's Claim, with the server's quota bookkeeping) as often as a reason
// to decide again comes, and says how the wait ended; the server records
// the metrics and turns the answer into a response.
package waiting

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// How a wait ended, the values of the "ended" attribute of idemreg.waits
// and idemreg.wait.duration.
const (
	Completed = "completed" // the record was completed: the result is replayed
	Acquired  = "acquired"  // the lease ended or was released: the caller took over
	Parked    = "parked"    // the record was parked: OUTCOME_PARKED
	Elapsed   = "elapsed"   // wait passed with the key still in progress
	Canceled  = "canceled"  // the caller's context ended
	Full      = "full"      // the replica had its waiters (or the identity its share): answered at once
	Drained   = "drained"   // the server was shutting down
	Error     = "error"     // the store failed (or the fingerprint did not match)
)

// The bounds that refuse a wait, the values of the "bound" attribute of
// idemreg.waits.refused.
const (
	BoundServer   = "server"   // the replica had its MaxWaiters waiting
	BoundIdentity = "identity" // the identity had its share of them
)

// Hub wakes the Claims waiting on a key when this replica changes it.
type Hub struct {
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
	changed chan struct{} // closed by Notify
	refs    int
	// marked is the token whose attempt this replica has marked the
	// record for (Claim.Mark), so that the waiters on one key mark it
	// once between two Notifies; 0 when none has.
	marked atomic.Int64
}

// NewHub keeps at most maxWaiters, and perIdentity of each identity when
// it is less.
func NewHub(maxWaiters, perIdentity int) *Hub {
	h := &Hub{keys: map[storage.Key]*waitKey{}, max: maxWaiters, draining: make(chan struct{})}
	if perIdentity < maxWaiters {
		h.perIdentity, h.byIdentity = perIdentity, map[string]int{}
	}
	return h
}

// join registers a waiter on k for identity (empty: a caller with no
// share of its own); it returns the bound that refused it instead, if one
// did.
func (h *Hub) join(k storage.Key, identity string) (*waitKey, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n >= h.max {
		return nil, BoundServer
	}
	shared := h.byIdentity != nil && identity != ""
	if shared && h.byIdentity[identity] >= h.perIdentity {
		return nil, BoundIdentity
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

func (h *Hub) leave(k storage.Key, w *waitKey, identity string) {
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

// Notify wakes every waiter on k.
func (h *Hub) Notify(k storage.Key) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if w := h.keys[k]; w != nil {
		close(w.changed)
		delete(h.keys, k)
	}
}

// Waiting reports how many Claims wait asleep for a change of their key.
func (h *Hub) Waiting() int { return int(h.asleep.Load()) }

// Drain ends every wait, now and to come.
func (h *Hub) Drain() { h.drainOnce.Do(func() { close(h.draining) }) }

// A Claim to decide while waiting.
type Claim struct {
	Key storage.Key
	// Share is the identity whose share of the waiters the Claim takes,
	// empty for a caller with no share of its own.
	Share string
	// End is when the wait must answer.
	End time.Time
	// Recheck is how often to look at the record for changes made through
	// other replicas.
	Recheck time.Duration
	// Decide decides the Claim (every decision's answer is settled by it).
	Decide func(ctx context.Context) (storage.ClaimResult, error)
	// Lookup reads the record, for the re-checks.
	Lookup func(ctx context.Context, k storage.Key) (storage.Record, error)
	// Mark, when set, marks the record for this replica while the attempt
	// of token is in progress (storage.WaitMarker), so that a replica that
	// ends it tells this one; false when the attempt has ended (decide
	// again at once). Nil on a store that keeps no marks: changes through
	// other replicas are then noticed by the re-checks alone.
	Mark func(ctx context.Context, token int64) (bool, error)
}

// maxUnmarked bounds the decisions in a row that a refused mark sends
// back at once (the mark's view and the decision's may differ by a clock
// tick): the next one sleeps, and the re-checks take over.
const maxUnmarked = 2

// Outcome is how a wait went: Ended is empty when the first decision
// needed no wait, Refused the bound that kept the Claim from waiting.
type Outcome struct {
	Ended, Refused string
}

// Joined is a waiter registered on a key before a decision, so that no
// change after the decision is missed; Refused is the bound that kept it
// from registering, if one did.
type Joined struct {
	w       *waitKey
	Refused string
}

// Join registers a waiter for c before a decision made elsewhere (a
// batch's statement); Wait goes on from that decision.
func (h *Hub) Join(c Claim) Joined {
	w, refused := h.join(c.Key, c.Share)
	return Joined{w: w, Refused: refused}
}

// Claim decides c, registered as a waiter on its key before each decision,
// and waits for a reason to decide again while the key is in progress
// under another holder's live lease.
func (h *Hub) Claim(ctx context.Context, c Claim) (storage.ClaimResult, error, Outcome) {
	j := h.Join(c)
	res, err := c.Decide(ctx)
	return h.Wait(ctx, c, j, res, err)
}

// Wait goes on from the decision (res, err) made after j: it answers at
// once when that decision needs no wait, and otherwise decides again
// (c.Decide, registered anew before each) as reasons come, until the key
// is no longer in progress or the wait ends.
func (h *Hub) Wait(ctx context.Context, c Claim, j Joined, res storage.ClaimResult, err error) (storage.ClaimResult, error, Outcome) {
	var (
		o        Outcome
		unmarked int
	)
	for round := 0; ; round++ {
		if round > 0 {
			j = h.Join(c)
			res, err = c.Decide(ctx)
		}
		joined := j.Refused == ""
		switch {
		case err != nil:
			o.Ended = Error
		case res.Outcome == storage.OutcomeCompleted:
			o.Ended = Completed
		case res.Outcome == storage.OutcomeAcquired:
			o.Ended = Acquired
		case res.Outcome == storage.OutcomeParked:
			o.Ended = Parked // nobody holds it: nothing to wait for
		case !joined:
			o.Ended, o.Refused = Full, j.Refused
		case !time.Now().Before(c.End):
			o.Ended = Elapsed
		}
		if o.Ended != "" {
			if joined {
				h.leave(c.Key, j.w, c.Share)
			}
			if round == 0 && o.Ended != Full {
				o.Ended = "" // answered at once: no wait
			}
			return res, err, o
		}
		if !h.mark(ctx, c, j.w, res.Record.Token) && unmarked < maxUnmarked {
			unmarked++
			h.leave(c.Key, j.w, c.Share)
			continue // the attempt ended after the decision: decide again
		}
		decided := time.Now()
		o.Ended = h.sleep(ctx, c, j.w, res)
		h.leave(c.Key, j.w, c.Share)
		if o.Ended != "" {
			res.RetryAfter = max(res.RetryAfter-time.Since(decided), 0)
			return res, err, o
		}
	}
}

// mark marks the record of c for the attempt of token, once per waitKey,
// and reports false only when the store says the attempt has ended. A
// failed mark is no reason to decide again: the re-checks cover it.
func (h *Hub) mark(ctx context.Context, c Claim, w *waitKey, token int64) bool {
	if c.Mark == nil || w.marked.Load() == token {
		return true
	}
	ok, err := c.Mark(ctx, token)
	if err != nil {
		return true
	}
	if ok {
		w.marked.Store(token)
	}
	return ok
}

// sleep waits on w until a reason to decide again (it returns "") or the
// end of the wait (it returns how it ended).
func (h *Hub) sleep(ctx context.Context, c Claim, w *waitKey, res storage.ClaimResult) string {
	h.asleep.Add(1)
	defer h.asleep.Add(-1)
	leaseEnd := time.Now().Add(res.RetryAfter)
	for {
		d := min(time.Until(leaseEnd), time.Until(c.End), c.Recheck)
		timer := time.NewTimer(max(d, 0))
		select {
		case <-w.changed:
			timer.Stop()
			return ""
		case <-ctx.Done():
			timer.Stop()
			return Canceled
		case <-h.draining:
			timer.Stop()
			return Drained
		case <-timer.C:
		}
		now := time.Now()
		switch {
		case !now.Before(leaseEnd):
			return "" // the lease may have ended: decide again
		case !now.Before(c.End):
			return Elapsed
		}
		// A re-check for changes made through other replicas: a read,
		// and a Claim only when it shows another state.
		rec, err := c.Lookup(ctx, c.Key)
		if err != nil || rec.State != storage.StateInProgress || rec.Token != res.Record.Token || !rec.LeaseExpiresAt.Equal(res.Record.LeaseExpiresAt) {
			return ""
		}
	}
}
