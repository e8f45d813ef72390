package server

import (
	"context"
	"errors"
	"log/slog"
	"unicode"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage"
)

// MaxReasonBytes bounds the reason of an InvalidateRecord.
const MaxReasonBytes = 256

// AdminService implements idemregv1.AdminServiceServer: an operator's view
// of a record as stored, and its invalidation. Every call is logged with the
// caller's identity and what it did, never with the record's fingerprint,
// token or result.
type AdminService struct {
	idemregv1.UnimplementedAdminServiceServer
	svc   *Service // for toStatus and the logger
	store *observedStore
	m     *metrics
}

// InspectRecord implements AdminServiceServer.
func (a *AdminService) InspectRecord(ctx context.Context, req *idemregv1.InspectRecordRequest) (*idemregv1.InspectRecordResponse, error) {
	var v violations
	k := v.key(req.GetConsumer(), req.GetKind(), req.GetKey())
	if err := v.err(); err != nil {
		return nil, err
	}
	if a.store.admin == nil {
		return nil, status.Error(codes.Unimplemented, "the store has no admin capability")
	}
	got, err := a.store.Inspect(ctx, k)
	a.audit(ctx, "inspect", k, "", err, slog.Bool("live", err == nil && got.Record.Live(got.Now)))
	if err != nil {
		return nil, a.svc.toStatus(ctx, "InspectRecord", k, err)
	}
	rec, err := toRecord(got.Record, true)
	if err != nil {
		return nil, a.svc.toStatus(ctx, "InspectRecord", k, err)
	}
	return &idemregv1.InspectRecordResponse{Record: rec, StoreTime: timestamp(got.Now), Live: got.Record.Live(got.Now)}, nil
}

// InvalidateRecord implements AdminServiceServer.
func (a *AdminService) InvalidateRecord(ctx context.Context, req *idemregv1.InvalidateRecordRequest) (*idemregv1.InvalidateRecordResponse, error) {
	var v violations
	k := v.key(req.GetConsumer(), req.GetKind(), req.GetKey())
	if req.GetToken() < 0 {
		v.add("token", "must be positive, or zero for any")
	}
	reason := req.GetReason()
	switch {
	case reason == "":
		v.add("reason", "required: say why, for the audit log")
	case len(reason) > MaxReasonBytes:
		v.add("reason", "must be at most %d bytes, got %d", MaxReasonBytes, len(reason))
	case !utf8.ValidString(reason):
		v.add("reason", "must be valid UTF-8")
	default:
		for i, r := range reason {
			if !unicode.IsPrint(r) {
				v.add("reason", "must be printable, found U+%04X at byte %d", r, i)
				break
			}
		}
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	if a.store.admin == nil {
		return nil, status.Error(codes.Unimplemented, "the store has no admin capability")
	}
	got, err := a.store.Invalidate(ctx, storage.InvalidateParams{Key: k, Token: req.GetToken()})
	a.audit(ctx, "invalidate", k, reason, err, slog.Bool("expected_token", req.GetToken() != 0), slog.Int64("attempt", got.Attempt))
	if err != nil {
		return nil, a.svc.toStatus(ctx, "InvalidateRecord", k, err)
	}
	a.svc.waiters.notify(k) // the lease ended: a waiter takes over
	rec, err := toRecord(got, true)
	if err != nil {
		return nil, a.svc.toStatus(ctx, "InvalidateRecord", k, err)
	}
	return &idemregv1.InvalidateRecordResponse{Record: rec}, nil
}

// audit logs one admin action and counts it.
func (a *AdminService) audit(ctx context.Context, action string, k storage.Key, reason string, err error, extra ...slog.Attr) {
	result := "ok"
	switch {
	case errors.Is(err, storage.ErrNotFound):
		result = ReasonNotFound
	case errors.Is(err, storage.ErrLeaseLost):
		result = ReasonLeaseLost
	case errors.Is(err, errOverloaded):
		result = ReasonOverloaded
	case err != nil:
		result = "error"
	}
	identity := ""
	if id, ok := IdentityFrom(ctx); ok {
		identity = id.Name
	}
	a.m.adminActions.Add(ctx, 1, attrs(attribute.String("action", action), attribute.String("result", result)))
	fields := []slog.Attr{
		slog.String("action", action), slog.String("identity", identity),
		slog.String("consumer", echo(k.Consumer)), slog.String("kind", kindName(k.Kind)), slog.String("key", echo(k.Key)),
		slog.String("result", result),
	}
	if reason != "" {
		fields = append(fields, slog.String("reason", echo(reason)))
	}
	level := slog.LevelInfo
	if action != "inspect" {
		level = slog.LevelWarn // a change an operator made by hand
	}
	a.svc.logger.LogAttrs(ctx, level, "admin action", append(fields, extra...)...)
}
