package pebble

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Membership = (*Store)(nil)

// members is the embedded store's membership: in memory, because one
// process alone opens the data directory (the directory lock), so the
// membership is only ever that process's replica, and a restart is a new
// member anyway.
type members struct {
	mu   sync.Mutex
	rows map[string]storage.Member
}

// Heartbeat implements storage.Membership.
func (s *Store) Heartbeat(ctx context.Context, p storage.HeartbeatParams) error {
	if err := s.begin(ctx); err != nil {
		return err
	}
	defer s.end()
	now := s.clock()
	m := &s.members
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.rows == nil {
		m.rows = map[string]storage.Member{}
	}
	row, ok := m.rows[p.ID]
	if !ok {
		row = storage.Member{ID: p.ID, JoinedAt: now}
	}
	row.Address, row.HeartbeatAt = p.Address, now
	m.rows[p.ID] = row
	if p.RemoveAfter > 0 {
		for id, r := range m.rows {
			if id != p.ID && r.HeartbeatAt.Before(now.Add(-p.RemoveAfter)) {
				delete(m.rows, id)
			}
		}
	}
	return nil
}

// Members implements storage.Membership.
func (s *Store) Members(ctx context.Context, liveFor time.Duration) (storage.MemberList, error) {
	if err := s.begin(ctx); err != nil {
		return storage.MemberList{}, err
	}
	defer s.end()
	out := storage.MemberList{Now: s.clock()}
	m := &s.members
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range m.rows {
		if r.HeartbeatAt.After(out.Now.Add(-liveFor)) {
			out.Members = append(out.Members, r)
		}
	}
	slices.SortFunc(out.Members, func(a, b storage.Member) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Leave implements storage.Membership.
func (s *Store) Leave(ctx context.Context, id string) error {
	if err := s.begin(ctx); err != nil {
		return err
	}
	defer s.end()
	s.members.mu.Lock()
	defer s.members.mu.Unlock()
	delete(s.members.rows, id)
	return nil
}
