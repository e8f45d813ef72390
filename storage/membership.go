package storage

import (
	"context"
	"time"
)

// Membership is implemented by stores that keep the replicas sharing them:
// a row per replica, with the address its peers reach it on and the store's
// clock at its last heartbeat. Replicas find each other through it (the
// cross-replica wake-up of waiting Claims, and anything that needs the
// number of live replicas, such as a limit shared between them).
//
// Liveness is judged by the store's clock alone, on both the writing and
// the reading side, so the replicas' own clocks may differ: a member is live
// while the store's clock is less than LiveFor past its last heartbeat.
//
// A store that serves one process (the embedded store) keeps its members
// in memory: there is only ever the one replica.
type Membership interface {
	// Heartbeat records p.ID at p.Address with the store's clock as its
	// heartbeat, creating the row on the first call (and again after Leave,
	// or after another member removed it as dead), and deletes the rows of
	// other members whose last heartbeat is more than p.RemoveAfter old
	// (none when p.RemoveAfter is zero). Errors: ErrUnavailable.
	Heartbeat(ctx context.Context, p HeartbeatParams) error
	// Members returns the members whose heartbeat is less than liveFor
	// old by the store's clock, ordered by ID, and that clock's reading.
	// Errors: ErrUnavailable.
	Members(ctx context.Context, liveFor time.Duration) (MemberList, error)
	// Leave deletes the row of id (a replica shutting down), so that its
	// peers stop counting it at once. Deleting an absent row is no error.
	// Errors: ErrUnavailable.
	Leave(ctx context.Context, id string) error
}

// HeartbeatParams are the arguments of Membership.Heartbeat.
type HeartbeatParams struct {
	// ID names the replica: unique to one run of one process, so that a
	// restarted replica is a new member and an old mark naming the dead
	// one names nobody.
	ID string
	// Address is host:port, where the replica's peers reach it.
	Address string
	// RemoveAfter is how old a heartbeat must be before its row is deleted
	// as dead; zero deletes none.
	RemoveAfter time.Duration
}

// Member is one replica, as the store keeps it.
type Member struct {
	ID      string
	Address string
	// JoinedAt is the store's clock at the member's first heartbeat.
	JoinedAt time.Time
	// HeartbeatAt is the store's clock at its last heartbeat.
	HeartbeatAt time.Time
}

// MemberList is the answer of Membership.Members.
type MemberList struct {
	// Members are the live members, ordered by ID.
	Members []Member
	// Now is the store's clock when they were read.
	Now time.Time
}

// WaitMarker is implemented by stores shared by replicas that keep, on a
// record, which replicas have a Claim waiting for its current attempt to
// end: the waiting Claim marks it, and the call that ends the attempt
// returns the marks in its answer (Record.Waiters), in the same statement,
// so that the replica that ended it tells the waiting ones at once, and a
// call that ends an attempt nobody waits for costs nothing more. Only
// waiting Claims pay for the marks. A mark is a hint: whoever is told
// decides again with the store.
type WaitMarker interface {
	// MarkWaiting adds p.Replica to the record's waiters while the attempt
	// of p.Token is in progress with its lease live, and reports whether
	// it is (false: the attempt ended, or the key is absent; the waiter
	// should decide again at once). A call that ends the attempt after
	// MarkWaiting returned true returns the mark. The marks are cleared
	// when a Claim next acquires the record. Errors: ErrUnavailable.
	MarkWaiting(ctx context.Context, p MarkWaitingParams) (bool, error)
}

// MarkWaitingParams are the arguments of WaitMarker.MarkWaiting.
type MarkWaitingParams struct {
	Key
	// Token is the token of the attempt the Claim waits for.
	Token int64
	// Replica is the waiting Claim's replica (its membership ID).
	Replica string
}
