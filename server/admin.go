package server

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/pagetoken"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// MaxReasonBytes bounds the reason of an InvalidateRecord or a
// ResolveRecord.
const MaxReasonBytes = 256

// ListRecords bounds: DefaultListPageSize is the page of a request that
// gives none, MaxListPageSize the largest a request may ask for (each page
// reads at most storage.ListScanLimit of it), MaxListOlderThan the largest
// older_than, far past any retention, so that the store's arithmetic on it
// stays in range.
const (
	DefaultListPageSize = 100
	MaxListPageSize     = 500
	MaxListOlderThan    = 10 * 365 * 24 * time.Hour
)

// AdminService implements idemregv1.AdminServiceServer: an operator's view
// of records as stored, their listing and resolution, and their
// invalidation. Every call is logged with the caller's identity and what
// it did (audit), never with a record's fingerprint, token or result.
type AdminService struct {
	idemregv1.UnimplementedAdminServiceServer
	statuses
	limits Limits
	// secrets seal and open the page tokens of ListRecords.
	secrets *claimsecret.Secrets
	// ended wakes the waiters on a key, here and on the replicas that
	// marked it, when an operator ends its lease or result.
	ended func(storage.Key, []string)
	// store is the service's store chain as a storage.Admin, nil when the
	// store cannot administer records.
	store storage.Admin
	m     *metrics
	// types are the message types a resolution's response is checked
	// against and encoded from JSON by (nil: the linked ones).
	types *resulttype.Types
}

// newAdminService returns the AdminService beside svc, on its store chain,
// checking resolutions' responses against types.
func newAdminService(svc *Service, types *resulttype.Types) *AdminService {
	return &AdminService{statuses: svc.statuses, limits: svc.limits, secrets: svc.secrets, ended: svc.ended,
		store: svc.store.Admin(), m: svc.metrics, types: types}
}

// errNoAdmin answers every call when the store cannot administer records.
var errNoAdmin = status.Error(codes.Unimplemented, "the store has no admin capability")

// InspectRecord implements AdminServiceServer.
func (a *AdminService) InspectRecord(ctx context.Context, req *idemregv1.InspectRecordRequest) (*idemregv1.InspectRecordResponse, error) {
	var v violations
	k := v.key(req.GetConsumer(), req.GetKind(), req.GetKey())
	if err := v.err(); err != nil {
		return nil, err
	}
	if a.store == nil {
		return nil, errNoAdmin
	}
	got, err := a.store.Inspect(ctx, k)
	a.audit(ctx, "inspect", keyAttrs(k), "", err, slog.Bool("live", err == nil && got.Record.Live(got.Now)))
	if err != nil {
		return nil, a.toStatus(ctx, "InspectRecord", k, err)
	}
	rec, err := toRecord(got.Record, true)
	if err != nil {
		return nil, a.toStatus(ctx, "InspectRecord", k, err)
	}
	return &idemregv1.InspectRecordResponse{Record: rec, StoreTime: timestamp(got.Now), Live: got.Record.Live(got.Now),
		History: toAttempts(got.Record.History)}, nil
}

// InvalidateRecord implements AdminServiceServer.
func (a *AdminService) InvalidateRecord(ctx context.Context, req *idemregv1.InvalidateRecordRequest) (*idemregv1.InvalidateRecordResponse, error) {
	var v violations
	k := v.key(req.GetConsumer(), req.GetKind(), req.GetKey())
	if req.GetToken() < 0 {
		v.add("token", "must be positive, or zero for any")
	}
	v.reason("reason", req.GetReason())
	if err := v.err(); err != nil {
		return nil, err
	}
	if a.store == nil {
		return nil, errNoAdmin
	}
	reason := req.GetReason()
	got, err := a.store.Invalidate(ctx, storage.InvalidateParams{Key: k, Token: req.GetToken(), Reason: reason})
	a.audit(ctx, "invalidate", keyAttrs(k), reason, err, slog.Bool("expected_token", req.GetToken() != 0), slog.Int64("attempt", got.Attempt))
	if err != nil {
		return nil, a.toStatus(ctx, "InvalidateRecord", k, err)
	}
	a.ended(k, got.Waiters) // the lease ended: a waiter takes over
	rec, err := toRecord(got, true)
	if err != nil {
		return nil, a.toStatus(ctx, "InvalidateRecord", k, err)
	}
	return &idemregv1.InvalidateRecordResponse{Record: rec}, nil
}

// Resolutions, the values of the "resolution" field of a resolve's audit
// line.
const (
	resolvedCompleted = "completed"
	resolvedReleased  = "released"
)

// ResolveRecord implements AdminServiceServer.
func (a *AdminService) ResolveRecord(ctx context.Context, req *idemregv1.ResolveRecordRequest) (*idemregv1.ResolveRecordResponse, error) {
	p, checked, err := a.validateResolve(req)
	if err != nil {
		return nil, err
	}
	if a.store == nil {
		return nil, errNoAdmin
	}
	got, err := a.store.Resolve(ctx, p)
	fields := []slog.Attr{slog.String("resolution", resolvedReleased)}
	if p.Complete {
		fields[0] = slog.String("resolution", resolvedCompleted)
		// What kind of result the operator stored, never the result.
		if f := req.GetResult().GetFailure(); f != nil {
			fields = append(fields, slog.String("result_outcome", "failure"), slog.Int("failure_code", int(f.GetCode())))
		} else {
			// Unchecked: stored as given, of a type the registry does not
			// know, which the operator's tooling must vouch for.
			fields = append(fields, slog.String("result_outcome", "response"), slog.Bool("response_checked", checked),
				slog.Bool("response_from_json", req.GetResponseJson() != nil))
		}
	}
	if attempt, ok := a.resolvedAttempt(ctx, p, got, err); ok {
		fields = append(fields, slog.Int64("attempt", attempt))
	}
	a.audit(ctx, "resolve", keyAttrs(p.Key), p.Reason, err, fields...)
	if err != nil {
		return nil, a.toStatus(ctx, "ResolveRecord", p.Key, err)
	}
	// Released, a waiter takes over; completed, it replays the result.
	a.ended(p.Key, got.Waiters)
	rec, err := toRecord(got, true)
	if err != nil {
		return nil, a.toStatus(ctx, "ResolveRecord", p.Key, err)
	}
	return &idemregv1.ResolveRecordResponse{Record: rec, ResponseChecked: checked}, nil
}

// resolvedAttempt is the attempt a successful resolution ended, for the
// audit log. A completed record keeps its attempt; a released one starts
// again from 0, and Resolve returns no history, so the ended attempt is read
// back from the history entry of the token resolved: tokens are never
// reused, and an attempt changes only with the token, so that entry is the
// one this call wrote. The read costs a store call per release, which an
// operator's action can afford; when it fails, the line goes without.
func (a *AdminService) resolvedAttempt(ctx context.Context, p storage.ResolveParams, got storage.Record, err error) (int64, bool) {
	if err != nil {
		return 0, false
	}
	if p.Complete {
		return got.Attempt, true
	}
	back, err := a.store.Inspect(ctx, p.Key)
	if err != nil {
		return 0, false
	}
	for _, h := range back.Record.History {
		if h.Token == p.Token {
			return h.Attempt, true
		}
	}
	return 0, false
}

// validateResolve checks a resolution and returns what to store, and
// whether the response it stores was checked against its type.
func (a *AdminService) validateResolve(r *idemregv1.ResolveRecordRequest) (p storage.ResolveParams, checked bool, err error) {
	var v violations
	p = storage.ResolveParams{Key: v.key(r.GetConsumer(), r.GetKind(), r.GetKey()), Token: r.GetToken(), Reason: r.GetReason()}
	if p.Token <= 0 {
		v.add("token", "required: the record's current token, as InspectRecord or ListRecords showed it")
	}
	v.reason("reason", p.Reason)
	switch res := r.GetResolution().(type) {
	case nil:
		v.add("resolution", "required: a result to complete the record with, or release: true")
	case *idemregv1.ResolveRecordRequest_Release:
		if !res.Release {
			v.add("release", "must be true to release the record; give a result to complete it instead")
		}
	case *idemregv1.ResolveRecordRequest_Result:
		// The same checks and encoding as Complete's: Claims replay it as
		// if its holder had stored it. Unlike a holder's, an operator's
		// bytes were written by hand, so a response of a known type must
		// also decode as it: else every Claim of the key would fail to
		// decode the replay for the record's whole retention.
		p.Complete = true
		if resp := res.Result.GetResponse(); resp != nil {
			checked = v.decodes("result.response", resp.GetType(), resp.GetData(), a.types)
		}
		p.Result = v.result("result", res.Result, a.limits.MaxResultBytes)
	case *idemregv1.ResolveRecordRequest_ResponseJson:
		p.Complete = true
		checked = true
		resp := v.fromJSON("response_json", res.ResponseJson, a.types)
		p.Result = v.result("response_json", &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: resp}}, a.limits.MaxResultBytes)
	}
	return p, checked, v.err()
}

// ListRecords implements AdminServiceServer.
func (a *AdminService) ListRecords(ctx context.Context, req *idemregv1.ListRecordsRequest) (*idemregv1.ListRecordsResponse, error) {
	p, filters, err := validateList(req)
	if err != nil {
		return nil, err
	}
	if a.store == nil {
		return nil, errNoAdmin
	}
	may, err := administrable(ctx, p.Consumer, p.Prefix)
	if err != nil {
		return nil, err
	}
	issuer, err := a.secrets.Issuer(ctx)
	if err != nil {
		return nil, a.toStatus(ctx, "ListRecords", storage.Key{Consumer: p.Consumer}, err)
	}
	if t := req.GetPageToken(); t != "" {
		var v violations
		if gen, ok := pagetoken.Generation(t); !ok {
			v.add("page_token", "%s", pagetoken.ErrGarbled)
		} else if opener, err := a.secrets.Sealer(ctx, gen); err != nil {
			return nil, a.toStatus(ctx, "ListRecords", storage.Key{Consumer: p.Consumer}, err)
		} else if opener == nil {
			v.add("page_token", "was sealed under a claim key generation this registry no longer accepts (the key was rotated): list again from the first page, without a page token")
		} else {
			if after, err := pagetoken.Open(opener, t, filters, p); err != nil {
				v.add("page_token", "%s", err)
			} else {
				p.After = &after
			}
		}
		if v.err() != nil {
			return nil, v.err()
		}
	}
	page, err := a.store.List(ctx, p)
	out := &idemregv1.ListRecordsResponse{StoreTime: timestamp(page.Now)}
	for _, r := range page.Records {
		if may != nil && !may(r.Consumer) {
			continue
		}
		// A listing never carries results (InspectRecord has them), even
		// from a store that read one.
		r.Result = nil
		rec, cerr := toRecord(r, true)
		if cerr != nil {
			err = cerr
			break
		}
		out.Records = append(out.Records, &idemregv1.ListedRecord{Record: rec, History: toAttempts(r.History)})
	}
	a.audit(ctx, "list", listAttrs(p), "", err, slog.Int("page_size", p.Limit), slog.Int("records", len(out.Records)),
		slog.Bool("more", err == nil && page.Next != nil))
	if err != nil {
		return nil, a.toStatus(ctx, "ListRecords", storage.Key{Consumer: p.Consumer}, err)
	}
	if page.Next != nil {
		out.NextPageToken = pagetoken.Encode(issuer.Sealer, issuer.Generation, filters, *page.Next)
	}
	return out, nil
}

// CountParked implements AdminServiceServer.
func (a *AdminService) CountParked(ctx context.Context, req *idemregv1.CountParkedRequest) (*idemregv1.CountParkedResponse, error) {
	var v violations
	prefix := req.GetConsumerPrefix()
	v.consumerPrefix("consumer_prefix", prefix)
	if err := v.err(); err != nil {
		return nil, err
	}
	if a.store == nil {
		return nil, errNoAdmin
	}
	may, err := administrable(ctx, prefix, true)
	if err != nil {
		return nil, err
	}
	counts, err := a.store.CountParked(ctx, prefix)
	out := &idemregv1.CountParkedResponse{Parked: make(map[string]int64, len(counts))}
	for consumer, n := range counts {
		if may == nil || may(consumer) {
			out.Parked[consumer] = n
		}
	}
	a.audit(ctx, "count_parked", []slog.Attr{slog.String("consumer_prefix", reason.Echo(prefix))}, "", err, slog.Int("consumers", len(out.Parked)))
	if err != nil {
		return nil, a.toStatus(ctx, "CountParked", storage.Key{Consumer: prefix}, err)
	}
	return out, nil
}

// administrable returns the filter of the consumers the caller may
// administer among those a request reaches (consumer, or with prefix every
// consumer starting with it), or nil when it may administer them all. The
// authorize interceptor has already refused a caller that may administer
// none of them; what is left is the caller granted part of a prefix, whose
// listing shows only its part. No identity means the handler runs outside
// the interceptors, which never happens in New: refused, not opened.
func administrable(ctx context.Context, consumer string, prefix bool) (func(string) bool, error) {
	id, ok := IdentityFrom(ctx)
	if !ok {
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
	if !prefix {
		return nil, nil // the interceptor checked the one consumer
	}
	if all, _ := id.MayAdministerUnder(consumer); all {
		return nil, nil
	}
	return id.MayAdminister, nil
}

func keyAttrs(k storage.Key) []slog.Attr {
	return []slog.Attr{slog.String("consumer", reason.Echo(k.Consumer)), slog.String("kind", kindName(k.Kind)), slog.String("key", reason.Echo(k.Key))}
}

func listAttrs(p storage.ListParams) []slog.Attr {
	out := []slog.Attr{slog.String("consumer", reason.Echo(p.Consumer)), slog.Bool("consumer_prefix", p.Prefix)}
	if p.State != 0 {
		out = append(out, slog.String("state", idemregv1.State(p.State).String()))
	}
	if p.MinAttempt > 0 {
		out = append(out, slog.Int64("min_attempt", p.MinAttempt))
	}
	if p.OlderThan > 0 {
		out = append(out, slog.Duration("older_than", p.OlderThan))
	}
	if p.After != nil {
		out = append(out, slog.Bool("continued", true))
	}
	return out
}

// readOnlyActions are the admin actions that change nothing: logged at
// INFO, the others at WARN.
var readOnlyActions = map[string]bool{"inspect": true, "list": true, "count_parked": true}

// audit logs one admin action as an audit event (who: the identity; what:
// the action and its target; when: the line's time; why: the reason) and
// counts it by action and result: ok, or the reason the caller is answered
// with (reason.Answer).
func (a *AdminService) audit(ctx context.Context, action string, target []slog.Attr, why string, err error, extra ...slog.Attr) {
	result := "ok"
	if err != nil {
		result = reason.Answer(ctx, err).Reason()
	}
	identity := ""
	if id, ok := IdentityFrom(ctx); ok {
		identity = id.Name
	}
	a.m.adminActions.Add(ctx, 1, attrs(attribute.String("action", action), attribute.String("result", result)))
	fields := append([]slog.Attr{slog.String("action", action), slog.String("identity", identity)}, target...)
	fields = append(fields, slog.String("result", result))
	if why != "" {
		fields = append(fields, slog.String("reason", reason.Echo(why)))
	}
	level := slog.LevelWarn // a change an operator made by hand
	if readOnlyActions[action] {
		level = slog.LevelInfo
	}
	a.logger.LogAttrs(ctx, level, "admin action", append(fields, extra...)...)
}

// MaxPageTokenBytes bounds a page_token before it is decoded.
const MaxPageTokenBytes = pagetoken.MaxBytes

// validateList checks a ListRecords request and returns the store's
// parameters and the digest of its filters. The page token is opened
// after (ListRecords), under the store's key, and only for valid filters,
// since it is checked against them.
func validateList(r *idemregv1.ListRecordsRequest) (storage.ListParams, pagetoken.Filters, error) {
	var v violations
	p := storage.ListParams{Consumer: r.GetConsumer(), Prefix: r.GetConsumerPrefix(), State: storage.State(r.GetState()),
		MinAttempt: r.GetMinAttempt()}
	switch {
	case p.Prefix:
		v.consumerPrefix("consumer", p.Consumer) // empty: every consumer
	case p.Consumer == "":
		v.add("consumer", "required: the consumer to list, or set consumer_prefix to list every consumer whose name starts with consumer")
	default:
		v.consumerPrefix("consumer", p.Consumer)
	}
	if _, ok := idemregv1.State_name[int32(r.GetState())]; !ok {
		v.add("state", "must be a State (STATE_UNSPECIFIED for any), got %d", r.GetState())
	}
	if p.MinAttempt < 0 {
		v.add("min_attempt", "must not be negative (0: any), got %d", p.MinAttempt)
	}
	if d := r.GetOlderThan(); d != nil {
		switch err := d.CheckValid(); {
		case err != nil:
			v.add("older_than", "invalid duration: %v", err)
		case d.AsDuration() < 0:
			v.add("older_than", "must not be negative, got %v", d.AsDuration())
		case d.AsDuration() > MaxListOlderThan:
			v.add("older_than", "must be at most %v, got %v", MaxListOlderThan, d.AsDuration())
		default:
			// Stores keep microseconds; both backends must see the same value.
			p.OlderThan = d.AsDuration().Truncate(time.Microsecond)
		}
	}
	switch n := r.GetPageSize(); {
	case n == 0:
		p.Limit = DefaultListPageSize
	case n < 0 || n > MaxListPageSize:
		v.add("page_size", "must be between 1 and %d, or 0 for %d, got %d", MaxListPageSize, DefaultListPageSize, n)
	default:
		p.Limit = int(n)
	}
	if n := len(r.GetPageToken()); n > pagetoken.MaxBytes {
		v.add("page_token", "must be at most %d bytes, got %d", pagetoken.MaxBytes, n)
	}
	return p, pagetoken.Digest(p), v.err()
}
