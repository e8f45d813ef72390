package postgres

import (
	"sync"
	"time"
)

// Defaults of the sweep cursor (WithSweepCursor).
const (
	// DefaultSweepCursorLag keeps the cursor at least this far behind the
	// horizon of the batch that moved it.
	DefaultSweepCursorLag = time.Minute
	// DefaultSweepRescanEvery is how often a sweep starts from the oldest
	// expiry again.
	DefaultSweepRescanEvery = time.Hour
)

// sweepCursor is the lower bound on expires_at from which SweepExpired
// scans, so that a batch does not walk again over the rows the batches
// before it deleted. On PostgreSQL a dead index entry is cheap to skip (and
// vacuum removes it); on CockroachDB a deleted row stays as an MVCC
// tombstone for gc.ttlseconds (4 h by default), and every scan from the
// oldest expiry reads through all of them before it finds a live row.
//
// Why a record below the cursor is not left behind. The cursor moves to the
// latest expiry a batch deleted, never past its horizon minus lag. Every
// record with an earlier expiry was read by that batch's index scan (it is
// ordered by expires_at) and deleted, or kept because it had been extended,
// which moved its expiry later. A record written afterwards has an expiry
// of at least its writer's now() plus its retention (storage/rules.go:
// Claim sets now+lease+retention, Complete now+retention, Extend and the
// admin calls only move it later, Release leaves it), and the server's
// limits keep both positive (server.DefaultMinLease 1 s,
// DefaultMinRetention 1 min). So it is at or after the cursor unless its
// writer's clock read more than lag+retention behind the sweep's horizon.
//
// That does not strictly hold, hence the bounds: database time is not one
// clock (CockroachDB gateways may differ by up to its max offset, 500 ms by
// default; a PostgreSQL host's clock may step back), now() is the start of
// the writer's transaction, which may commit long after it read its clock,
// and the storage layer accepts any retention (tests use tiny ones). So:
//   - the cursor stays lag behind the horizon (DefaultSweepCursorLag, a
//     minute: a writer would have to be over a minute plus its retention
//     behind the sweeper);
//   - a horizon earlier than the last one (the clock stepped back) resets
//     it, for the batch after the one that saw it;
//   - once rescanEvery (by database time, as the last batch read it) has
//     passed since the last batch that started from the oldest expiry, the
//     next one does again, so anything missed anyway is deleted late,
//     never kept.
//
// A record missed until then costs only storage: reads check expiry
// themselves (storage.Record.Live). The cursor is per Store: another
// process's sweeper has its own, and two sweeps here move it to the later
// of their bounds.
type sweepCursor struct {
	lag, rescanEvery time.Duration // rescanEvery <= 0: no cursor

	mu       sync.Mutex
	after    time.Time // zero: from the oldest expiry
	lastNow  time.Time // horizon of the last batch
	rescanAt time.Time // horizon of the last batch that started from the oldest
}

// from returns the bound the next batch starts from; zero means the oldest
// expiry.
func (c *sweepCursor) from() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.rescanEvery <= 0 || c.lastNow.Sub(c.rescanAt) >= c.rescanEvery {
		return time.Time{}
	}
	return c.after
}

// moved records a batch that started at from, ran at horizon now and
// deleted records up to latest (zero when it deleted none); short says it
// deleted fewer than its limit, which moves nothing more: see below.
func (c *sweepCursor) moved(from, now, latest time.Time, short bool) {
	if c.rescanEvery <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Before(c.lastNow) {
		// The clock stepped back: records written since may expire before
		// the cursor. Start again from the oldest.
		c.after, c.lastNow, c.rescanAt = time.Time{}, now, time.Time{}
		return
	}
	c.lastNow = now
	// Only to what was deleted: a batch that deleted fewer than its limit
	// is not proof that nothing was left in [from, now], since rows it
	// picked may have been deleted by another sweeper first, so that the
	// rows after its pick were never read (TestConcurrentSweepersOnPostgres).
	bound := now.Add(-c.lag)
	if latest.IsZero() && !from.IsZero() {
		return
	}
	if latest.Before(bound) {
		bound = latest
	}
	switch {
	case from.IsZero():
		// A rescan: what it found replaces the cursor, so that the
		// batches after it go on from there rather than from a cursor
		// that moved past records it found.
		c.rescanAt, c.after = now, bound
	case bound.After(c.after):
		c.after = bound
	}
}
