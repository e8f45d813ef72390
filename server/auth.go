package server

import (
	"context"
	"strings"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
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
	if s.cfg.File != nil {
		c := s.cfg.File.Current()
		return &configSnapshot{access: c.Access, policy: c.Policy}
	}
	return &configSnapshot{access: s.cfg.Access.Current(), policy: s.policies.Current()}
}

// accessFor returns the access set of the request of ctx.
func (s *Server) accessFor(ctx context.Context) *access.Set {
	if snap, ok := ctx.Value(configKey{}).(*configSnapshot); ok {
		return snap.access
	}
	return s.cfg.Access.Current()
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
		strings.HasPrefix(c.Service, "grpc.reflection.")
}

// authenticate finds the caller's identity. A bearer token, when sent,
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
	return newStatus(idemregv1.ErrorReason_ERROR_REASON_UNAUTHENTICATED, msg, nil)
}

// authorize checks, before the handler reads anything, that the caller may
// use the request's consumer: RegistryService needs a consumers grant,
// AdminService an admin grant (for a request by consumer prefix, a grant
// of at least one consumer under it). A method of any other service that
// is not public is refused: new services must be added here on purpose.
func (s *Server) authorize(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	id, ok := IdentityFrom(ctx)
	if !ok {
		return nil, newStatus(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
	service, _, _ := strings.Cut(strings.TrimPrefix(info.FullMethod, "/"), "/")
	if consumers, ok := batchConsumers(req); ok && service == idemregv1.RegistryService_ServiceDesc.ServiceName {
		// Each item on its own: a refused item is that item's answer.
		if err := batchBounds(req.(proto.Message), len(consumers)); err != nil {
			return nil, err
		}
		verdicts, ctx := verdictsFor(ctx, len(consumers))
		for i, c := range consumers {
			if !id.MayUse(c) {
				verdicts[i] = s.denied(ctx, id, c, "")
			}
		}
		return next(ctx, req)
	}
	if prefix, ok := adminPrefix(req); ok && service == idemregv1.AdminService_ServiceDesc.ServiceName {
		// Many consumers, not one: the handler shows only those the
		// identity may administer (administrable). One that may administer
		// none of them is refused here, as for a single consumer.
		if _, some := id.MayAdministerUnder(prefix); !some {
			return nil, s.denied(ctx, id, prefix, "identity "+quote(id.Name)+" may administer no consumer whose name starts with "+quote(echo(prefix)))
		}
		return next(ctx, req)
	}
	r, hasConsumer := req.(interface{ GetConsumer() string })
	if !hasConsumer {
		return nil, s.denied(ctx, id, "", "the method is not open to identities")
	}
	consumer := r.GetConsumer()
	var allowed bool
	switch service {
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

// adminPrefix returns the consumer prefix of an AdminService request that
// reaches every consumer whose name starts with it: a ListRecords with
// consumer_prefix, and every CountParked.
func adminPrefix(req any) (string, bool) {
	switch r := req.(type) {
	case *idemregv1.ListRecordsRequest:
		return r.GetConsumer(), r.GetConsumerPrefix()
	case *idemregv1.CountParkedRequest:
		return r.GetConsumerPrefix(), true
	}
	return "", false
}

func (s *Server) denied(ctx context.Context, id *access.Identity, consumer, msg string) error {
	s.metrics.denied.Add(ctx, 1, codeAttr(codes.PermissionDenied))
	if msg == "" {
		msg = "identity " + quote(id.Name) + " may not use consumer " + quote(echo(consumer))
	}
	return newStatus(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED, msg,
		map[string]string{"identity": id.Name, "consumer": consumer})
}

func quote(s string) string { return "\"" + s + "\"" }

// rateLimit applies the rate limits of the config file: the identity's
// bucket, then the consumer's; to each item of a batch on its own. The
// identity's comes first because it is the tenant's bound: a caller granted
// a prefix can invent consumer names, each with a fresh bucket, but its
// calls all take from one identity's.
func (s *Server) rateLimit(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	if !strings.HasPrefix(info.FullMethod, "/"+idemregv1.RegistryService_ServiceDesc.ServiceName+"/") {
		return next(ctx, req)
	}
	if consumers, ok := batchConsumers(req); ok {
		if err := batchBounds(req.(proto.Message), len(consumers)); err != nil {
			return nil, err
		}
		verdicts, ctx := verdictsFor(ctx, len(consumers))
		for i, c := range consumers {
			if verdicts[i] == nil {
				verdicts[i] = s.allow(ctx, c)
			}
		}
		return next(ctx, req)
	}
	r, ok := req.(interface{ GetConsumer() string })
	if !ok {
		return next(ctx, req)
	}
	if err := s.allow(ctx, r.GetConsumer()); err != nil {
		return nil, err
	}
	return next(ctx, req)
}

// allow takes one call for consumer from the identity's bucket and the
// consumer's, or answers RATE_LIMITED.
func (s *Server) allow(ctx context.Context, consumer string) error {
	set := s.accessFor(ctx)
	name := ""
	if id, ok := IdentityFrom(ctx); ok {
		name = id.Name
		if l, limited := set.IdentityRateLimit(name); limited && id != access.Anonymous {
			if ok, wait := s.limiter.Allow("identity:"+name, l); !ok {
				s.metrics.rateLimited.Add(ctx, 1, identityAttr(name))
				return rateLimited("identity "+quote(echo(name))+" is over its rate limit of "+l.String(),
					"identity:"+echo(name), l, wait, map[string]string{"identity": name, "consumer": consumer})
			}
		}
	}
	l, limited := set.RateLimit(consumer)
	if !limited {
		return nil
	}
	if ok, wait := s.limiter.Allow("consumer:"+consumer, l); !ok {
		s.metrics.rateLimited.Add(ctx, 1, identityAttr(name))
		return rateLimited("consumer "+quote(echo(consumer))+" is over its rate limit of "+l.String(),
			"consumer:"+echo(consumer), l, wait, map[string]string{"consumer": consumer})
	}
	return nil
}

func rateLimited(msg, subject string, l access.Limit, wait time.Duration, meta map[string]string) error {
	return newStatus(idemregv1.ErrorReason_ERROR_REASON_RATE_LIMITED, msg, meta,
		&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{Subject: subject, Description: l.String()}}},
		retryInfo(wait))
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
