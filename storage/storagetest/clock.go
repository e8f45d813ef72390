// Package storagetest is the conformance suite every storage backend runs:
// the semantics table of docs/semantics.md, token monotonicity, expiry, and
// the races that decide ownership, and the cases of every optional
// capability. A backend's test makes one call, All with a factory, which
// runs every area the store's capabilities allow and says which it skips;
// new semantics go into this suite first.
package storagetest

import (
	"sync/atomic"
	"time"
)

// Clock moves a store's clock forward for tests. Backends add Offset to
// their own clock reading (the database's now() for SQL stores), so the
// suite can step past leases and retention windows without sleeping.
type Clock struct{ offset atomic.Int64 }

// Offset is how far the store's clock has been moved forward.
func (c *Clock) Offset() time.Duration { return time.Duration(c.offset.Load()) }

// Advance moves the store's clock forward by d.
func (c *Clock) Advance(d time.Duration) { c.offset.Add(int64(d)) }

// Now is the local clock moved by Offset, for stores whose clock is local.
func (c *Clock) Now() time.Time { return time.Now().Add(c.Offset()) }
