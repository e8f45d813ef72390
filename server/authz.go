package server

import (
	"context"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// authorize checks, before the handler reads anything, that the caller may
// use the request's consumer: RegistryService needs a consumers grant,
// AdminService an admin grant (for a request by consumer prefix, a grant
// of at least one consumer under it). A method of any other service that
// is not public is refused: new services must be added here on purpose.
func (s *Server) authorize(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	id, ok := IdentityFrom(ctx)
	if !ok {
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
	service, _, _ := strings.Cut(strings.TrimPrefix(info.FullMethod, "/"), "/")
	if consumers, ok := batchConsumers(req); ok && service == idemregv1.RegistryService_ServiceDesc.ServiceName {
		// Each item on its own: a refused item is that item's answer.
		if err := batchBounds(req.(proto.Message), len(consumers)); err != nil {
			return nil, err
		}
		verdicts, ctx := verdictsFor(ctx, req, len(consumers))
		for i, c := range consumers {
			if verdicts[i] == nil && !id.MayUse(c) {
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
			return nil, s.denied(ctx, id, prefix, "identity "+quote(id.Name)+" may administer no consumer whose name starts with "+quote(reason.Echo(prefix)))
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
	case *idemregv1.BeginBackupRequest, *idemregv1.ReadBackupRequest, *idemregv1.EndBackupRequest:
		// Every consumer; the handler asks for a grant on all (backup.go).
		return "", true
	}
	return "", false
}

func (s *Server) denied(ctx context.Context, id *access.Identity, consumer, msg string) error {
	s.metrics.denied.Add(ctx, 1, codeAttr(codes.PermissionDenied))
	if msg == "" {
		msg = "identity " + quote(id.Name) + " may not use consumer " + quote(reason.Echo(consumer))
	}
	return reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED, msg,
		map[string]string{"identity": id.Name, "consumer": consumer})
}

func quote(s string) string { return "\"" + s + "\"" }
