// Package replicas is this replica's place among the replicas sharing a
// store, and what the server asks of them: the membership
// (server/internal/membership: each replica heartbeats a row with its ID
// and the address its peers reach it on, when the store keeps a
// membership), the link to the peers (server/internal/peers: a replica
// whose call ends an attempt tells the replicas whose Claims wait for the
// key), and this replica's share of what the config file's limits allow
// all of them together: a rate limit (Share) and a quota (Count, which
// server/internal/quota divides by).
//
// Waits across replicas (docs/design.md, "Waits across replicas"): a
// Claim waiting on this replica marks the record with this replica's ID
// (storage.WaitMarker, MarkFor); a replica whose call ends the attempt
// gets the marks back from its own statement and tells the replicas they
// name (Tell), whose hubs wake their waiters (Register). The waiters'
// re-check stays, for peers that cannot be told.
//
// Before Join, and on a store that keeps no membership, the replica is
// alone: Count is 1, Share the whole limit, and Tell and MarkFor do
// nothing.
package replicas

import (
	"cmp"
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/membership"
	"github.com/idemreg/idemreg/server/internal/peers"
	"github.com/idemreg/idemreg/storage"
)

// Defaults of Config.
const (
	DefaultHeartbeat = membership.DefaultInterval
	DefaultLiveFor   = membership.DefaultLiveFor
)

// Instrument names, in the server's scope (docs/operations.md).
const (
	MetricPeerWakes = "idemreg.peer.wakes"
	// MetricPeerWakesReceived counts the Wakes this replica was sent, by
	// result (server/internal/peers: woken, stale, replayed,
	// other_replica, unsealed).
	MetricPeerWakesReceived = "idemreg.peer.wakes.received"
)

// Config configures Replicas.
type Config struct {
	// ID names this replica in the membership (membership.NewID when
	// empty).
	ID string
	// AdvertiseAddress is host:port, where the other replicas reach this
	// one; empty: the listener's address given to Join, or the host name
	// with its port when the listener's host is unspecified.
	AdvertiseAddress string
	// Heartbeat and LiveFor are the membership's interval and liveness
	// (membership.Config; zero: the defaults).
	Heartbeat, LiveFor time.Duration
	// Store is the backend: its membership (storage.Membership) and wait
	// marks (storage.WaitMarker), when it keeps them.
	Store storage.Store
	// Keys are the claim keys the peers' messages are sealed under.
	Keys *claimsecret.Secrets
	// TLS is the server's TLS configuration, nil when it serves
	// plaintext: peers are dialled likewise (Credentials).
	TLS *tls.Config
	// Meter makes the instruments; Logger receives the membership's and
	// the sender's failures (nil discards them).
	Meter  metric.Meter
	Logger *slog.Logger
}

// Replicas is this replica among those sharing the store. It is safe for
// concurrent use; its methods are safe on a nil *Replicas, which is
// alone.
type Replicas struct {
	cfg                  Config
	wakes, wakesReceived metric.Int64Counter
	members              atomic.Pointer[membership.Members]
	link                 atomic.Pointer[link]
}

// link is what a serving replica knows of its peers: set by Join.
type link struct {
	self string
	tell *peers.Sender
	// marker marks records for waiting Claims; nil when the store keeps
	// no marks (the embedded store, alone by construction).
	marker storage.WaitMarker
}

// New returns the replica cfg describes, alone until Join.
func New(cfg Config) (*Replicas, error) {
	cfg.ID = cmp.Or(cfg.ID, membership.NewID())
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	r := &Replicas{cfg: cfg}
	var err error
	if r.wakes, err = cfg.Meter.Int64Counter(MetricPeerWakes, metric.WithUnit("{key}"),
		metric.WithDescription("Keys whose end this replica told another replica with a Claim waiting for it, by result (sent, failed, dropped, not_live); all but sent leave the waiters to their re-check.")); err != nil {
		return nil, fmt.Errorf("replicas: metrics: %w", err)
	}
	if r.wakesReceived, err = cfg.Meter.Int64Counter(MetricPeerWakesReceived, metric.WithUnit("{call}"),
		metric.WithDescription("Wake calls of other replicas received, by result: woken, or refused as stale (sealed outside the freshness window), replayed (a sequence already taken), unsealed; other_replica wakes nothing. A refused Wake wakes nothing.")); err != nil {
		return nil, fmt.Errorf("replicas: metrics: %w", err)
	}
	return r, nil
}

// ID is this replica's ID in the membership.
func (r *Replicas) ID() string { return r.cfg.ID }

// Join makes this replica, serving on lis, a member, and links it to its
// peers until ctx ends. It returns the membership's heartbeat loop, for
// the caller to run until ctx ends (the replica leaves when it returns),
// or nil, the replica alone, when the store keeps no membership.
func (r *Replicas) Join(ctx context.Context, lis net.Addr) (run func()) {
	ms, ok := r.cfg.Store.(storage.Membership)
	if !ok {
		return nil
	}
	m := membership.New(ms, membership.Config{
		ID: r.cfg.ID, Address: cmp.Or(r.cfg.AdvertiseAddress, advertiseAddress(lis)),
		Interval: r.cfg.Heartbeat, LiveFor: r.cfg.LiveFor, Logger: r.cfg.Logger,
	})
	marker, _ := r.cfg.Store.(storage.WaitMarker)
	count := func(result string, n int) {
		r.wakes.Add(ctx, int64(n), metric.WithAttributes(attribute.String("result", result)))
	}
	sender := peers.NewSender(ctx, peers.SenderConfig{
		Self: m.ID(), Keys: peerKeys{r.cfg.Keys}, Address: m.Address, Creds: r.credentials(),
		Count: count, Logger: r.cfg.Logger,
	})
	r.members.Store(m)
	r.link.Store(&link{self: m.ID(), tell: sender, marker: marker})
	return func() { m.Run(ctx) }
}

// Register serves the peers' Wakes on s: each wakes this replica's
// waiters on the keys it names through notify.
func (r *Replicas) Register(s grpc.ServiceRegistrar, notify func(storage.Key)) {
	peers.Register(s, peers.NewReceiver(r.cfg.ID, peerKeys{r.cfg.Keys}, notify,
		peers.WithCount(func(result string) {
			r.wakesReceived.Add(context.Background(), 1, metric.WithAttributes(attribute.String("result", result)))
		})))
}

// Count is the number of live replicas sharing the config file's limits,
// this one included, as the membership last read them: 1 when alone.
func (r *Replicas) Count() int {
	if r == nil {
		return 1
	}
	if m := r.members.Load(); m != nil {
		return m.Count()
	}
	return 1
}

// Share is this replica's share of the rate limit l, which the live
// replicas share (docs/operations.md, "Limits across replicas").
func (r *Replicas) Share(l access.Limit) access.Limit { return l.Share(r.Count()) }

// Members returns the replicas sharing the store as this one last read
// them (this one among them once it has heartbeat), nil when alone.
func (r *Replicas) Members() []storage.Member {
	if r == nil {
		return nil
	}
	if m := r.members.Load(); m != nil {
		return m.Live()
	}
	return nil
}

// Tell tells the replicas of waiters (the marks on a record, from the
// answer of the call that ended its attempt) that k ended, without
// waiting for them.
func (r *Replicas) Tell(k storage.Key, waiters []string) {
	if r == nil || len(waiters) == 0 {
		return
	}
	if l := r.link.Load(); l != nil {
		l.tell.Tell(k, waiters)
	}
}

// MarkFor is the Mark of a Claim waiting on k: it marks the record with
// this replica's ID, so that the replica ending the attempt tells this
// one. Nil when the store keeps no marks or the replica has not joined.
func (r *Replicas) MarkFor(k storage.Key) func(context.Context, int64) (bool, error) {
	if r == nil {
		return nil
	}
	l := r.link.Load()
	if l == nil || l.marker == nil {
		return nil
	}
	return func(ctx context.Context, token int64) (bool, error) {
		return l.marker.MarkWaiting(ctx, storage.MarkWaitingParams{Key: k, Token: token, Replica: l.self})
	}
}

// peerKeys seals the peers' messages under the store's claim keys.
type peerKeys struct{ s *claimsecret.Secrets }

func (k peerKeys) Current(ctx context.Context) (int64, []byte, error) {
	key, err := k.s.Issuer(ctx)
	return key.Generation, key.Key, err
}

func (k peerKeys) Generation(ctx context.Context, gen int64) ([]byte, bool, error) {
	key, ok, err := k.s.Generation(ctx, gen)
	return key.Key, ok, err
}

// credentials are the credentials peers are dialled with: plaintext
// when this server serves plaintext; otherwise TLS without verifying the
// peer's name (a pod IP no certificate names; the messages are sealed
// under the claim key, which is what authenticates them), presenting this
// server's own certificate to a peer that asks for one (mTLS).
func (r *Replicas) credentials() credentials.TransportCredentials {
	own := r.cfg.TLS
	if own == nil {
		return insecure.NewCredentials()
	}
	return credentials.NewTLS(&tls.Config{
		InsecureSkipVerify: true, //nolint:gosec // the payload is sealed under the claim key (server/internal/peers)
		MinVersion:         tls.VersionTLS12,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if own.GetCertificate != nil {
				if c, err := own.GetCertificate(&tls.ClientHelloInfo{}); err == nil && c != nil {
					return c, nil
				}
			}
			if len(own.Certificates) > 0 {
				return &own.Certificates[0], nil
			}
			return &tls.Certificate{}, nil
		},
	})
}

// advertiseAddress is where peers reach a replica listening on lis when
// it advertises nothing itself: the listener's address, or the host name
// with its port when the listener's host is unspecified.
func advertiseAddress(lis net.Addr) string {
	tcp, ok := lis.(*net.TCPAddr)
	if !ok {
		return lis.String()
	}
	if tcp.IP != nil && !tcp.IP.IsUnspecified() {
		return tcp.String()
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	return net.JoinHostPort(host, fmt.Sprint(tcp.Port))
}
