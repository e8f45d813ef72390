package server

import (
	"context"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

type identityKey struct{}

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
		strings.HasPrefix(c.Service, "grpc.reflection.")
}

// authenticate finds the caller's identity. A bearer token, when sent,
// decides it (an unknown one is refused even with a good certificate);
// otherwise the client certificate does, if the TLS handshake verified it
// against --tls-client-ca. An unverified certificate is never trusted.
func (s *Server) authenticate(ctx context.Context) (context.Context, error) {
	set := s.cfg.Access.Current()
	id, err := identify(ctx, set)
	if err != nil {
		s.metrics.denied.Add(ctx, 1, attrs(attribute.String("code", "unauthenticated")))
		return nil, err
	}
	noteIdentity(ctx, id.Name)
	return context.WithValue(ctx, identityKey{}, id), nil
}

func identify(ctx context.Context, set *access.Set) (*access.Identity, error) {
	if !set.Enforced() {
		return access.Anonymous, nil
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
	p, ok := peer.FromContext(ctx)
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
	return newStatus(codes.Unauthenticated, ReasonUnauthenticated, msg, nil)
}

// authorize checks, before the handler reads anything, that the caller may
// use the request's consumer: RegistryService needs a consumers grant,
// AdminService an admin grant. A method of any other service that is not
// public is refused: new services must be added here on purpose.
func (s *Server) authorize(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	id, ok := IdentityFrom(ctx)
	if !ok {
		return nil, newStatus(codes.Internal, ReasonInternal, "internal error", nil)
	}
	r, hasConsumer := req.(interface{ GetConsumer() string })
	if !hasConsumer {
		return nil, s.denied(ctx, id, "", "the method is not open to identities")
	}
	consumer := r.GetConsumer()
	var allowed bool
	switch service, _, _ := strings.Cut(strings.TrimPrefix(info.FullMethod, "/"), "/"); service {
	case idemregv1.RegistryService_ServiceDesc.ServiceName:
		allowed = id.MayUse(consumer)
	case idemregv1.AdminService_ServiceDesc.ServiceName:
		allowed = id.MayAdminister(consumer)
	}
	if !allowed {
		return nil, s.denied(ctx, id, consumer, "")
	}
	return next(ctx, req)
}

func (s *Server) denied(ctx context.Context, id *access.Identity, consumer, msg string) error {
	s.metrics.denied.Add(ctx, 1, attrs(attribute.String("code", "permission_denied")))
	if msg == "" {
		msg = "identity " + quote(id.Name) + " may not use consumer " + quote(echo(consumer))
	}
	return newStatus(codes.PermissionDenied, ReasonPermissionDenied, msg,
		map[string]string{"identity": id.Name, "consumer": consumer})
}

func quote(s string) string { return "\"" + s + "\"" }

// rateLimit applies the consumer's rate limit from the config file.
func (s *Server) rateLimit(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	r, ok := req.(interface{ GetConsumer() string })
	if !ok || !strings.HasPrefix(info.FullMethod, "/"+idemregv1.RegistryService_ServiceDesc.ServiceName+"/") {
		return next(ctx, req)
	}
	consumer := r.GetConsumer()
	l, limited := s.cfg.Access.Current().RateLimit(consumer)
	if !limited {
		return next(ctx, req)
	}
	if ok, wait := s.limiter.Allow(consumer, l); !ok {
		name := ""
		if id, ok := IdentityFrom(ctx); ok {
			name = id.Name
		}
		s.metrics.rateLimited.Add(ctx, 1, attrs(attribute.String("identity", name)))
		return nil, newStatus(codes.ResourceExhausted, ReasonRateLimited,
			"consumer "+quote(echo(consumer))+" is over its rate limit of "+l.String(),
			map[string]string{"consumer": consumer},
			&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
				Subject:     "consumer:" + echo(consumer),
				Description: l.String(),
			}}},
			retryInfo(wait))
	}
	return next(ctx, req)
}
