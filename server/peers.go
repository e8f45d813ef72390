package server

import (
	"context"
	"crypto/tls"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/membership"
	"github.com/idemreg/idemreg/server/internal/peers"
	"github.com/idemreg/idemreg/storage"
)

// Waits across replicas (docs/design.md, "Waits across replicas"): a
// Claim waiting on this replica marks the record with this replica's ID
// (storage.WaitMarker); a replica whose call ends the attempt gets the
// marks back from its own statement and tells the replicas they name
// (server/internal/peers), whose hubs wake their waiters. The re-check
// (WaitRecheck) stays, for peers that cannot be told.

// replicaLink is what a serving replica knows of its peers: set by Serve.
type replicaLink struct {
	self    string
	members *membership.Members
	tell    *peers.Sender
	// marker marks records for waiting Claims; nil when the store keeps
	// no marks (the embedded store, alone by construction).
	marker storage.WaitMarker
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

// ended wakes the waiters on k: this replica's at once, and those of the
// replicas that marked the record (waiters, from the answer of the call
// that ended the attempt), without waiting for them.
func (s *Service) ended(k storage.Key, waiters []string) {
	s.waiters.Notify(k)
	if len(waiters) == 0 {
		return
	}
	if l := s.replicas.Load(); l != nil {
		l.tell.Tell(k, waiters)
	}
}

// markFor is the Mark of a waiting Claim on k, nil when the store keeps
// no marks or the server is not serving.
func (s *Service) markFor(k storage.Key) func(context.Context, int64) (bool, error) {
	l := s.replicas.Load()
	if l == nil || l.marker == nil {
		return nil
	}
	return func(ctx context.Context, token int64) (bool, error) {
		return l.marker.MarkWaiting(ctx, storage.MarkWaitingParams{Key: k, Token: token, Replica: l.self})
	}
}

// link starts telling peers for the replica of m, until ctx ends.
func (s *Server) link(ctx context.Context, m *membership.Members) {
	marker, _ := s.store.(storage.WaitMarker)
	count := func(result string, n int) {
		s.metrics.peerWakes.Add(ctx, int64(n), attrs(attribute.String("result", result)))
	}
	sender := peers.NewSender(ctx, peers.SenderConfig{
		Self: m.ID(), Keys: peerKeys{s.svc.secrets}, Address: m.Address, Creds: s.peerCredentials(),
		Count: count, Logger: s.cfg.Logger,
	})
	s.svc.replicas.Store(&replicaLink{self: m.ID(), members: m, tell: sender, marker: marker})
}

// peerCredentials are the credentials peers are dialled with: plaintext
// when this server serves plaintext; otherwise TLS without verifying the
// peer's name (a pod IP no certificate names; the messages are sealed
// under the claim key, which is what authenticates them), presenting this
// server's own certificate to a peer that asks for one (mTLS).
func (s *Server) peerCredentials() credentials.TransportCredentials {
	if s.cfg.TLS == nil {
		return insecure.NewCredentials()
	}
	own := s.cfg.TLS
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
