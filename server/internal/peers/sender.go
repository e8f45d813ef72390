package peers

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/storage"
)

// Defaults of SenderConfig.
const (
	// DefaultTimeout bounds one Wake call: a peer that has not answered
	// by then is left to its re-checks.
	DefaultTimeout = 250 * time.Millisecond
	// DefaultQueue is how many keys may wait to be told to one peer; a
	// key beyond it is dropped (its waiters re-check).
	DefaultQueue = 4096
	// maxKeysPerCall bounds the keys one Wake carries.
	maxKeysPerCall = 512
	// idleAfter is how long a peer's sender stays without a key to tell
	// before it ends and closes its connection.
	idleAfter = time.Minute
)

// The results of telling a key, the values of the "result" attribute of
// idemreg.peer.wakes.
const (
	Sent    = "sent"     // the peer answered the Wake that carried the key
	Failed  = "failed"   // the Wake failed or timed out
	Dropped = "dropped"  // the peer's queue was full
	NotLive = "not_live" // the replica named is not a live member
)

// SenderConfig configures a Sender.
type SenderConfig struct {
	// Self is this replica's ID: marks naming it are not told.
	Self string
	// Keys seal the messages (the store's claim keys).
	Keys Keys
	// Address is where the live member id is reached, false when it is
	// not live (membership.Members.Address).
	Address func(id string) (string, bool)
	// Creds are the transport credentials peers are dialled with.
	Creds credentials.TransportCredentials
	// Timeout bounds each call (DefaultTimeout); Queue bounds the keys
	// queued for one peer (DefaultQueue).
	Timeout time.Duration
	Queue   int
	// Count is told how many keys ended with each result; nil for none.
	Count func(result string, n int)
	// Logger receives failed calls at debug level; nil discards them.
	Logger *slog.Logger
}

// Sender tells peers of ended attempts. It is safe for concurrent use.
type Sender struct {
	cfg  SenderConfig
	seal *sealers
	ctx  context.Context

	mu    sync.Mutex
	peers map[string]*peer // by replica ID

	// seq is the last sequence sealed (next).
	seq atomic.Int64
}

type peer struct {
	id   string
	keys chan storage.Key
}

// NewSender returns a Sender whose peers' goroutines end with ctx.
func NewSender(ctx context.Context, cfg SenderConfig) *Sender {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Queue <= 0 {
		cfg.Queue = DefaultQueue
	}
	if cfg.Count == nil {
		cfg.Count = func(string, int) {}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Sender{cfg: cfg, seal: &sealers{keys: cfg.Keys}, ctx: ctx, peers: map[string]*peer{}}
}

// Tell queues k for each replica of waiters but this one, without
// waiting: the call that ended k answers at once.
func (s *Sender) Tell(k storage.Key, waiters []string) {
	for _, id := range waiters {
		if id == s.cfg.Self {
			continue
		}
		if _, live := s.cfg.Address(id); !live {
			s.cfg.Count(NotLive, 1)
			continue
		}
		s.enqueue(id, k)
	}
}

// enqueue queues k for id's sender, started on first use. It holds mu so
// that an idle sender cannot end between the look-up and the send.
func (s *Sender) enqueue(id string, k storage.Key) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return // shutting down
	}
	p := s.peers[id]
	if p == nil {
		p = &peer{id: id, keys: make(chan storage.Key, s.cfg.Queue)}
		s.peers[id] = p
		go s.run(p)
	}
	select {
	case p.keys <- k:
	default:
		s.cfg.Count(Dropped, 1)
	}
}

// run sends what is queued for p, a call at a time, until ctx ends or p
// has been idle for idleAfter.
func (s *Sender) run(p *peer) {
	var (
		conn *grpc.ClientConn
		addr string
	)
	defer func() {
		if conn != nil {
			_ = conn.Close()
		}
	}()
	idle := time.NewTimer(idleAfter)
	defer idle.Stop()
	batch := make([]storage.Key, 0, maxKeysPerCall)
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-idle.C:
			s.mu.Lock()
			if len(p.keys) == 0 {
				delete(s.peers, p.id)
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			idle.Reset(idleAfter)
			continue
		case k := <-p.keys:
			batch = append(batch[:0], k)
		}
	more:
		for len(batch) < maxKeysPerCall {
			select {
			case k := <-p.keys:
				batch = append(batch, k)
			default:
				break more
			}
		}
		idle.Reset(idleAfter)
		a, live := s.cfg.Address(p.id)
		if !live {
			s.cfg.Count(NotLive, len(batch))
			continue
		}
		if a != addr || conn == nil {
			if conn != nil {
				_ = conn.Close()
			}
			var err error
			if conn, err = grpc.NewClient(a, grpc.WithTransportCredentials(s.cfg.Creds)); err != nil {
				conn = nil
				s.cfg.Count(Failed, len(batch))
				s.cfg.Logger.Debug("peers: dial failed", "peer", p.id, "address", a, "error", err)
				continue
			}
			addr = a
		}
		s.send(conn, p.id, batch)
	}
}

// next is the sequence of a message sealed now: the clock in Unix
// nanoseconds, or one more than the last when the clock has not moved on
// (or stepped back), so that a receiver can refuse any sequence it has
// already taken from this sender.
func (s *Sender) next() int64 {
	for {
		last := s.seq.Load()
		n := max(time.Now().UnixNano(), last+1)
		if s.seq.CompareAndSwap(last, n) {
			return n
		}
	}
}

func (s *Sender) send(conn *grpc.ClientConn, to string, keys []storage.Key) {
	m := message{From: s.cfg.Self, To: to, Keys: make([]wireKey, len(keys))}
	for i, k := range keys {
		m.Keys[i] = wireKey{Consumer: k.Consumer, Kind: uint8(k.Kind), Key: k.Key}
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.Timeout)
	defer cancel()
	m.Seq = s.next() // at the send, not when the keys were queued: the receiver measures its age
	sealed, err := s.seal.seal(ctx, m)
	if err == nil {
		err = conn.Invoke(ctx, wakeMethod, wrapperspb.Bytes(sealed), new(emptypb.Empty))
	}
	if err != nil {
		s.cfg.Count(Failed, len(keys))
		s.cfg.Logger.Debug("peers: wake failed; the peer's waiters notice by their re-check", "peer", to, "keys", len(keys), "error", err)
		return
	}
	s.cfg.Count(Sent, len(keys))
}
