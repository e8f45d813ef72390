package storagetest

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// membershipCases are the cases of the storage.Membership capability.
// Each needs a store of its own: they count members.
var membershipCases = []capabilityCase[storage.Membership]{
	{"Empty", testMembersEmpty},
	{"HeartbeatJoins", testHeartbeatJoins},
	{"LiveByStoreClock", testMembersLiveByStoreClock},
	{"HeartbeatRemovesDead", testHeartbeatRemovesDead},
	{"Leave", testLeave},
}

func memberIDs(l storage.MemberList) []string {
	ids := []string{}
	for _, m := range l.Members {
		ids = append(ids, m.ID)
	}
	return ids
}

func heartbeat(t *testing.T, m storage.Membership, id string, removeAfter time.Duration) {
	t.Helper()
	require.NoError(t, m.Heartbeat(t.Context(), storage.HeartbeatParams{ID: id, Address: "addr-" + id, RemoveAfter: removeAfter}))
}

func testMembersEmpty(t *testing.T, m storage.Membership, _ *Clock) {
	l, err := m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	require.Empty(t, l.Members)
	require.False(t, l.Now.IsZero(), "the store's clock is read even with no member")
}

// testHeartbeatJoins: the first heartbeat makes the row, the next ones
// move its heartbeat and its address and keep when it joined; members
// come ordered by ID.
func testHeartbeatJoins(t *testing.T, m storage.Membership, c *Clock) {
	heartbeat(t, m, "b", 0)
	heartbeat(t, m, "a", 0)
	l, err := m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, memberIDs(l))
	first := l.Members[0]
	require.Equal(t, "addr-a", first.Address)
	require.False(t, first.HeartbeatAt.After(l.Now))

	c.Advance(time.Second)
	require.NoError(t, m.Heartbeat(t.Context(), storage.HeartbeatParams{ID: "a", Address: "moved"}))
	l, err = m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	again := l.Members[0]
	require.Equal(t, "moved", again.Address)
	require.True(t, again.JoinedAt.Equal(first.JoinedAt), "joined_at stays: %v, %v", first.JoinedAt, again.JoinedAt)
	require.True(t, again.HeartbeatAt.After(first.HeartbeatAt), "the heartbeat moved: %v, %v", first.HeartbeatAt, again.HeartbeatAt)
}

// testMembersLiveByStoreClock: a member counts while the store's clock is
// less than liveFor past its heartbeat, and again once it beats again.
func testMembersLiveByStoreClock(t *testing.T, m storage.Membership, c *Clock) {
	heartbeat(t, m, "old", 0)
	c.Advance(2 * time.Second)
	heartbeat(t, m, "new", 0)
	l, err := m.Members(t.Context(), time.Second)
	require.NoError(t, err)
	require.Equal(t, []string{"new"}, memberIDs(l), "old's heartbeat is 2s old by the store's clock")
	l, err = m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{"new", "old"}, memberIDs(l), "a dead member's row stays until removed")
	heartbeat(t, m, "old", 0)
	l, err = m.Members(t.Context(), time.Second)
	require.NoError(t, err)
	require.Equal(t, []string{"new", "old"}, memberIDs(l))
}

// testHeartbeatRemovesDead: a heartbeat deletes the rows whose heartbeat
// is older than RemoveAfter, never its own.
func testHeartbeatRemovesDead(t *testing.T, m storage.Membership, c *Clock) {
	for i := range 3 {
		heartbeat(t, m, fmt.Sprintf("dead-%d", i), 0)
	}
	c.Advance(10 * time.Second)
	heartbeat(t, m, "recent", 0)
	c.Advance(5 * time.Second)
	heartbeat(t, m, "self", 8*time.Second)
	l, err := m.Members(t.Context(), time.Hour)
	require.NoError(t, err)
	require.Equal(t, []string{"recent", "self"}, memberIDs(l), "rows 15s old go, one 5s old stays")

	c.Advance(time.Hour)
	heartbeat(t, m, "self", time.Second) // its own row is written, not removed
	l, err = m.Members(t.Context(), time.Hour*2)
	require.NoError(t, err)
	require.Equal(t, []string{"self"}, memberIDs(l))
}

func testLeave(t *testing.T, m storage.Membership, _ *Clock) {
	heartbeat(t, m, "a", 0)
	heartbeat(t, m, "b", 0)
	require.NoError(t, m.Leave(t.Context(), "a"))
	require.NoError(t, m.Leave(t.Context(), "never-joined"))
	l, err := m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{"b"}, memberIDs(l))
	heartbeat(t, m, "a", 0) // a heartbeat after Leave joins again
	l, err = m.Members(t.Context(), time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, memberIDs(l))
}
