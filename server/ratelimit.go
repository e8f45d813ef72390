package server

import (
	"context"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/reason"
)

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
		verdicts, ctx := verdictsFor(ctx, req, len(consumers))
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
			l = s.replicas.Share(l)
			if ok, wait := s.limiter.Allow("identity:"+name, l); !ok {
				s.metrics.rateLimited.Add(ctx, 1, identityAttr(name))
				return rateLimited("identity "+quote(reason.Echo(name))+" is over its rate limit of "+l.String(),
					"identity:"+reason.Echo(name), l, wait, map[string]string{"identity": name, "consumer": consumer})
			}
		}
	}
	l, limited := set.RateLimit(consumer)
	if !limited {
		return nil
	}
	l = s.replicas.Share(l)
	if ok, wait := s.limiter.Allow("consumer:"+consumer, l); !ok {
		s.metrics.rateLimited.Add(ctx, 1, identityAttr(name))
		return rateLimited("consumer "+quote(reason.Echo(consumer))+" is over its rate limit of "+l.String(),
			"consumer:"+reason.Echo(consumer), l, wait, map[string]string{"consumer": consumer})
	}
	return nil
}

func rateLimited(msg, subject string, l access.Limit, wait time.Duration, meta map[string]string) error {
	if l.Replicas > 1 {
		meta["replicas"] = strconv.Itoa(l.Replicas)
	}
	return reason.Status(idemregv1.ErrorReason_ERROR_REASON_RATE_LIMITED, msg, meta,
		&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{Subject: subject, Description: l.String()}}},
		reason.RetryInfo(wait))
}
