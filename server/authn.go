package server

import (
	"context"
	"crypto/tls"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/peers"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/policy"
)

type identityKey struct{}

// configKey holds the request's *configSnapshot.
type configKey struct{}

// configSnapshot is the config a request is admitted and served under,
// read once when it arrives: its identity, rate limits and policy all come
// from one file, whatever reloads happen while it runs.
type configSnapshot struct {
	access *access.Set
	policy *policy.Set
}

func (s *Server) snapshot() *configSnapshot {
	c := s.cfg.File.Current()
	return &configSnapshot{access: c.Access, policy: c.Policy}
}

// accessFor returns the access set of the request of ctx.
func (s *Server) accessFor(ctx context.Context) *access.Set {
	if snap, ok := ctx.Value(configKey{}).(*configSnapshot); ok {
		return snap.access
	}
	return s.cfg.File.Current().Access
}

// IdentityFrom returns the identity the call was authenticated as.
func IdentityFrom(ctx context.Context) (*access.Identity, bool) {
	id, ok := ctx.Value(identityKey{}).(*access.Identity)
	return id, ok
}

// public reports whether a method is open to every caller: health, for
// probes and load balancers, and reflection, which describes the API but
// reads no record (DisableReflection turns it off).
func public(_ context.Context, c interceptors.CallMeta) bool {
	return c.Service == healthpb.Health_ServiceDesc.ServiceName ||
		// authenticated by its own seal, under the store's claim key
		// (server/internal/peers): replicas hold no caller credentials
		c.Service == peers.ServiceName ||
		strings.HasPrefix(c.Service, "grpc.reflection.")
}

// authenticate finds the caller's identity. On an InProcess connection
// the identity named by ActAs decides. Otherwise a bearer token, when sent,
// decides it (an unknown one is refused even with a good certificate);
// otherwise the client certificate does, if the TLS handshake verified it
// against --tls-client-ca. An unverified certificate is never trusted.
func (s *Server) authenticate(ctx context.Context) (context.Context, error) {
	snap := s.snapshot()
	id, err := identify(ctx, snap.access)
	if err != nil {
		s.metrics.denied.Add(ctx, 1, codeAttr(codes.Unauthenticated))
		return nil, err
	}
	noteIdentity(ctx, id.Name)
	return context.WithValue(context.WithValue(ctx, identityKey{}, id), configKey{}, snap), nil
}

// Authenticates reports whether a call of fullMethod ("/package.Service/Method")
// over a TLS connection in state (nil without TLS), with these
// Authorization header values, would pass authentication: the method is
// public, identities are not enforced, or its credentials name an identity.
// It is what a transcoder in front of the server asks before it reads a
// request's body, so that an unknown caller's body is never read or
// inflated; the server's own authentication of the call still decides.
func (s *Server) Authenticates(fullMethod string, state *tls.ConnectionState, authorization []string) bool {
	ctx := context.Background()
	if public(ctx, interceptors.NewServerCallMeta(fullMethod, nil, nil)) {
		return true
	}
	// What grpc-go's ServeHTTP gives the call of the peer and metadata
	// that identify reads (not its address).
	p := &peer.Peer{}
	if state != nil {
		p.AuthInfo = credentials.TLSInfo{State: *state}
	}
	ctx = peer.NewContext(ctx, p)
	if len(authorization) > 0 {
		ctx = metadata.NewIncomingContext(ctx, metadata.MD{"authorization": authorization})
	}
	_, err := identify(ctx, s.snapshot().access)
	return err == nil
}

func identify(ctx context.Context, set *access.Set) (*access.Identity, error) {
	if !set.Enforced() {
		return access.Anonymous, nil
	}
	p, ok := peer.FromContext(ctx)
	if names := metadata.ValueFromIncomingContext(ctx, actAsHeader); ok && len(names) > 0 {
		// Only the process itself can open an InProcess connection: there
		// the name decides; anywhere else it is ignored.
		if _, in := p.AuthInfo.(inProcessAuth); in {
			if id, found := set.ByName(names[0]); found && len(names) == 1 {
				return id, nil
			}
			return nil, unauthenticated("the identity the call is made as is not one of the config file")
		}
	}
	if len(metadata.ValueFromIncomingContext(ctx, "authorization")) > 0 {
		token, err := auth.AuthFromMD(ctx, "bearer")
		if err != nil {
			return nil, unauthenticated("the authorization header is not \"bearer <token>\"")
		}
		if id, ok := set.ByToken(token); ok {
			return id, nil
		}
		return nil, unauthenticated("unknown bearer token")
	}
	if ok {
		if tlsInfo, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(tlsInfo.State.VerifiedChains) > 0 {
			if id, ok := set.ByCertificate(tlsInfo.State.VerifiedChains[0][0]); ok {
				return id, nil
			}
			return nil, unauthenticated("the client certificate matches no identity of the config file")
		}
	}
	return nil, unauthenticated("no credentials: present a client certificate or an \"authorization: bearer <token>\" header")
}

func unauthenticated(msg string) error {
	return reason.Status(idemregv1.ErrorReason_ERROR_REASON_UNAUTHENTICATED, msg, nil)
}

// identityName is the identity charged for what the request of ctx
// makes the replica hold: the anonymous one for a caller of an open server
// (or a call that came through no interceptor).
func identityName(ctx context.Context) string {
	if id, ok := IdentityFrom(ctx); ok && id != nil {
		return id.Name
	}
	return access.Anonymous.Name
}
