// Package membership keeps this replica in the store's membership
// (storage.Membership) and knows its live peers.
//
// Run heartbeats the replica's row every Interval and reads the live
// members back in the same beat; a member is live while its heartbeat is
// less than LiveFor old by the store's clock, so replicas' clocks may
// differ. Each heartbeat also deletes the rows of members silent for
// RemoveAfter (a SIGKILLed replica never leaves). When Run ends (the
// server shuts down) the replica leaves, so that its peers stop counting
// it at once.
//
// What other packages read is the last membership read (Live, Address,
// Count): a read never waits for the store. A replica that cannot reach
// the store keeps its last view, and says so in Stale.
package membership

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Defaults of Config.
const (
	// DefaultInterval is how often a replica heartbeats and reads the
	// members.
	DefaultInterval = time.Second
	// DefaultLiveFor is how old a heartbeat may be for its member to
	// count as live: three intervals, so that one late or failed beat does
	// not drop a member.
	DefaultLiveFor = 3 * time.Second
	// DefaultRemoveAfter is how old a heartbeat must be before a peer
	// deletes its row.
	DefaultRemoveAfter = time.Minute
	// leaveTimeout bounds the Leave at shutdown.
	leaveTimeout = 2 * time.Second
)

// Config configures Members. Zero durations take the defaults.
type Config struct {
	// ID names this replica: unique to this run of the process
	// (NewID).
	ID string
	// Address is host:port, where peers reach this replica.
	Address string
	// Interval, LiveFor, RemoveAfter: see the defaults.
	Interval, LiveFor, RemoveAfter time.Duration
	// Logger receives the failures of heartbeats; nil discards them.
	Logger *slog.Logger
}

// Members is this replica's membership. It is safe for concurrent use.
type Members struct {
	store storage.Membership
	cfg   Config

	mu    sync.RWMutex
	live  []storage.Member
	addrs map[string]string // live members' addresses by ID
	read  time.Time         // local clock at the last successful read
	// ready is closed after the first beat, read or not.
	ready     chan struct{}
	readyOnce sync.Once
}

// New returns the membership of the replica cfg names in store. It does
// nothing until Run.
func New(store storage.Membership, cfg Config) *Members {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.LiveFor <= 0 {
		cfg.LiveFor = DefaultLiveFor
	}
	if cfg.RemoveAfter <= 0 {
		cfg.RemoveAfter = DefaultRemoveAfter
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Members{store: store, cfg: cfg, addrs: map[string]string{}, ready: make(chan struct{})}
}

// ID is this replica's ID.
func (m *Members) ID() string { return m.cfg.ID }

// Run heartbeats and reads the members every Interval until ctx ends,
// then leaves the membership.
func (m *Members) Run(ctx context.Context) {
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	for {
		m.Beat(ctx)
		select {
		case <-ctx.Done():
			lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaveTimeout)
			defer cancel()
			if err := m.store.Leave(lctx, m.cfg.ID); err != nil {
				m.cfg.Logger.Warn("membership: leave failed; peers drop this replica when its heartbeat is old", "error", err, "live_for", m.cfg.LiveFor)
			}
			return
		case <-t.C:
		}
	}
}

// Beat heartbeats once and reads the live members (Run calls it every
// Interval).
func (m *Members) Beat(ctx context.Context) {
	defer m.readyOnce.Do(func() { close(m.ready) })
	// Up to LiveFor: a beat slower than the interval still keeps the row
	// live, and the ticker skips the beats it overran.
	ctx, cancel := context.WithTimeout(ctx, m.cfg.LiveFor)
	defer cancel()
	err := m.store.Heartbeat(ctx, storage.HeartbeatParams{ID: m.cfg.ID, Address: m.cfg.Address, RemoveAfter: m.cfg.RemoveAfter})
	if err != nil {
		m.cfg.Logger.Warn("membership: heartbeat failed", "error", err)
		return
	}
	l, err := m.store.Members(ctx, m.cfg.LiveFor)
	if err != nil {
		m.cfg.Logger.Warn("membership: reading the members failed", "error", err)
		return
	}
	addrs := make(map[string]string, len(l.Members))
	for _, p := range l.Members {
		addrs[p.ID] = p.Address
	}
	m.mu.Lock()
	m.live, m.addrs, m.read = l.Members, addrs, time.Now()
	m.mu.Unlock()
}

// Ready is closed once Run has made its first beat.
func (m *Members) Ready() <-chan struct{} { return m.ready }

// Live returns the live members as last read, this replica among them
// once its first heartbeat is written; ordered by ID. The caller must not
// modify it.
func (m *Members) Live() []storage.Member {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.live
}

// Count is how many members were live at the last read, at least 1 (this
// replica, live or not in the store's eyes).
func (m *Members) Count() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if _, self := m.addrs[m.cfg.ID]; self {
		return len(m.live)
	}
	return len(m.live) + 1
}

// Address is where the live member id is reached, as last read; false
// when it was not live then.
func (m *Members) Address(id string) (string, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	a, ok := m.addrs[id]
	return a, ok
}

// Stale reports whether the last successful read is older than LiveFor:
// the view may miss members that joined, and count some that died.
func (m *Members) Stale() bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return time.Since(m.read) >= m.cfg.LiveFor
}

// NewID returns an ID for this run of the process: the host name (a
// Kubernetes pod's name), for the reader of the table, and random bytes,
// so that a restarted replica is a new member.
func NewID() string {
	host, _ := os.Hostname()
	b := make([]byte, 6)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	if host == "" {
		host = "replica"
	}
	return host + "-" + hex.EncodeToString(b)
}
