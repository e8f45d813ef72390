package server

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// violations collects the invalid fields of one request.
type violations []*errdetails.BadRequest_FieldViolation

func (v *violations) add(field, format string, args ...any) {
	*v = append(*v, &errdetails.BadRequest_FieldViolation{Field: field, Description: reason.Bounded(fmt.Sprintf(format, args...), MaxStatusMessageBytes)})
}

// err returns the INVALID_ARGUMENT status for the collected violations, or
// nil when there are none.
func (v violations) err() error {
	if len(v) == 0 {
		return nil
	}
	return invalidArgument(v)
}

// key validates the (consumer, kind, key) triple shared by every request.
func (v *violations) key(consumer string, kind idemregv1.Kind, key string) storage.Key {
	if consumer == "" {
		v.add("consumer", "required")
	} else {
		v.consumerPrefix("consumer", consumer)
	}
	k := storage.Kind(kind)
	if kind != idemregv1.Kind_KIND_MESSAGE && kind != idemregv1.Kind_KIND_OPERATION {
		v.add("kind", "must be KIND_MESSAGE or KIND_OPERATION, got %v", kind)
	}
	switch {
	case key == "":
		v.add("key", "required")
	case len(key) > MaxKeyBytes:
		v.add("key", "must be at most %d bytes, got %d", MaxKeyBytes, len(key))
	default:
		v.printable("key", key)
	}
	return storage.Key{Consumer: consumer, Kind: k, Key: key}
}

// consumerPrefix checks that s is a consumer name or the start of one:
// empty, or within the bounds and the charset of consumer names
// (storage.CheckConsumer).
func (v *violations) consumerPrefix(field, s string) {
	if err := storage.CheckConsumer(s); err != nil {
		v.add(field, "%s", err)
	}
}

// reason checks an operator's reason (InvalidateRecord, ResolveRecord): it
// goes to the audit log and the record's history, so it is required,
// short, and printable.
func (v *violations) reason(field, reason string) {
	switch {
	case reason == "":
		v.add(field, "required: say why, for the audit log")
	case len(reason) > MaxReasonBytes:
		v.add(field, "must be at most %d bytes, got %d", MaxReasonBytes, len(reason))
	default:
		v.printable(field, reason)
	}
}

// result checks a result to store (Complete, ResolveRecord) under field
// and returns its encoding: the bytes every later Claim replays, the same
// whoever stored them.
func (v *violations) result(field string, res *idemregv1.Result, maxBytes int) []byte {
	switch o := res.GetOutcome().(type) {
	case nil:
		v.add(field, "required: a response or a failure")
		return nil
	case *idemregv1.Result_Failure:
		if c := o.Failure.GetCode(); c <= 0 || c > 16 {
			v.add(field+".failure.code", "must be a google.rpc.Code other than OK (1-16), got %d", c)
		}
		// Stored and replayed to every later Claim, and shown to
		// operators: held to the check of every other stored text.
		v.printable(field+".failure.message", o.Failure.GetMessage())
	case *idemregv1.Result_Response:
		v.printable(field+".response.type", o.Response.GetType())
	}
	if n := proto.Size(res); n > maxBytes {
		v.add(field, "encoded result must be at most %d bytes, got %d", maxBytes, n)
		return nil
	}
	b, err := (proto.MarshalOptions{Deterministic: true}).Marshal(res)
	if err != nil {
		v.add(field, "cannot be encoded: %v", err)
		return nil
	}
	return b
}

// decodes checks that data decodes as the message type named typ when
// types know it, under field (a Response: field.data names the bytes), and
// reports whether they know it: the bytes of a type they do not know are
// stored unchecked.
func (v *violations) decodes(field, typ string, data []byte, types *resulttype.Types) bool {
	known, err := types.Check(typ, data)
	if err != nil {
		v.add(field+".data", "does not decode as %s (%v): give the bytes of its wire format, or the response as JSON in response_json (idemreg admin resolve --response-json), which the server encodes", typ, err)
	}
	return known
}

// fromJSON encodes a response given as JSON in its type's wire format,
// under field. The type must be known: JSON of a type the registry cannot
// resolve has no wire format to encode to.
func (v *violations) fromJSON(field string, r *idemregv1.JsonResponse, types *resulttype.Types) *idemregv1.Response {
	typ := r.GetType()
	if typ == "" {
		v.add(field+".type", "required: the response's full message name, such as google.protobuf.Int64Value")
		return nil
	}
	data, err := types.Encode(typ, r.GetJson())
	switch {
	case errors.Is(err, resulttype.ErrUnknownType):
		v.add(field+".type", "the registry does not know the message type %q (neither linked into the server nor in its --descriptor-set): give the response's wire-format bytes in result.response.data, or start the server with a descriptor set that defines it", typ)
		return nil
	case err != nil:
		v.add(field+".json", "is not %s in the protobuf JSON mapping: %v", typ, err)
		return nil
	}
	return &idemregv1.Response{Type: typ, Data: data}
}

// printable checks that s is valid UTF-8 of printable characters (letters,
// marks, numbers, punctuation, symbols, the ASCII space): no NUL, which
// PostgreSQL refuses in text while the embedded store would keep it, and
// nothing that rewrites a log line.
func (v *violations) printable(field, s string) {
	if !utf8.ValidString(s) {
		v.add(field, "must be valid UTF-8")
		return
	}
	if i := reason.Unprintable(s); i >= 0 {
		r, _ := utf8.DecodeRuneInString(s[i:])
		v.add(field, "must be printable, found U+%04X at byte %d", r, i)
	}
}

// duration validates an optional duration against the bounds b of a
// policy and returns b.Default when it is unset. A violation names the
// bound it broke and the policy it comes from (bound is the bounds' name in
// a policy file, source the policy's Source).
func (v *violations) duration(field string, d *durationpb.Duration, b policy.Bounds, bound, source string) time.Duration {
	if d == nil {
		return b.Default
	}
	if err := d.CheckValid(); err != nil {
		v.add(field, "invalid duration: %v", err)
		return 0
	}
	got := d.AsDuration()
	switch {
	case got < b.Min:
		v.add(field, "must be at least %s (%s.min of %s), got %v", policy.FormatDuration(b.Min), bound, source, got)
	case got > b.Max:
		v.add(field, "must be at most %s (%s.max of %s), got %v", policy.FormatDuration(b.Max), bound, source, got)
	}
	// Stores keep microseconds; both backends must see the same value.
	return got.Truncate(time.Microsecond)
}

// fence checks the token and claim secret of a Complete, Release or
// Extend; whether the secret is the token's is decided after validation
// (claimSecrets.check).
func (v *violations) fence(t int64, secret []byte) {
	if t <= 0 {
		v.add("token", "required: the positive token returned by Claim")
	}
	switch n := len(secret); {
	case n == 0:
		v.add("claim_secret", "required: the claim_secret returned by the Claim that acquired the token")
	case n != claimsecret.Size:
		v.add("claim_secret", "must be %d bytes, got %d", claimsecret.Size, n)
	}
}

func (s *Service) validateClaim(ctx context.Context, r *idemregv1.ClaimRequest) (storage.ClaimParams, time.Duration, error) {
	var v violations
	k := v.key(r.GetConsumer(), r.GetKind(), r.GetKey())
	if n := len(r.GetFingerprint()); n > MaxFingerprintBytes {
		v.add("fingerprint", "must be at most %d bytes, got %d", MaxFingerprintBytes, n)
	}
	switch h := r.GetHolder(); {
	case len(h) > MaxHolderBytes:
		v.add("holder", "must be at most %d bytes, got %d", MaxHolderBytes, len(h))
	default:
		v.printable("holder", h)
	}
	if id := r.GetRequestId(); len(id) > MaxRequestIDBytes {
		v.add("request_id", "must be at most %d bytes, got %d", MaxRequestIDBytes, len(id))
	} else if !printableASCII(id) {
		v.add("request_id", "must be printable ASCII without spaces (0x21-0x7E)")
	}
	pol := s.policyFor(ctx, k.Consumer)
	p := storage.ClaimParams{
		Key:         k,
		Fingerprint: r.GetFingerprint(),
		Lease:       v.duration("lease", r.GetLease(), pol.Lease, "lease", pol.Source),
		Retention: v.duration("retention", r.GetRetention(), pol.Retention(k.Kind),
			policy.RetentionField(k.Kind), pol.Source),
		Holder:      r.GetHolder(),
		RequestID:   r.GetRequestId(),
		MaxAttempts: pol.MaxAttempts,
	}
	var wait time.Duration
	if w := r.GetWait(); w != nil {
		wait = v.duration("wait", w, policy.Bounds{Min: 0, Max: MaxWait}, "wait", "the server")
	}
	return p, wait, v.err()
}

// printableASCII reports whether s has only bytes 0x21-0x7E.
func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7E {
			return false
		}
	}
	return true
}

func (s *Service) validateComplete(r *idemregv1.CompleteRequest) (storage.CompleteParams, error) {
	var v violations
	p := storage.CompleteParams{Key: v.key(r.GetConsumer(), r.GetKind(), r.GetKey()), Token: r.GetToken()}
	v.fence(r.GetToken(), r.GetClaimSecret())
	p.Result = v.result("result", r.GetResult(), s.limits.MaxResultBytes)
	return p, v.err()
}

func (s *Service) validateRelease(r *idemregv1.ReleaseRequest) (storage.ReleaseParams, error) {
	var v violations
	p := storage.ReleaseParams{Key: v.key(r.GetConsumer(), r.GetKind(), r.GetKey()), Token: r.GetToken()}
	v.fence(r.GetToken(), r.GetClaimSecret())
	return p, v.err()
}

func (s *Service) validateExtend(ctx context.Context, r *idemregv1.ExtendRequest) (storage.ExtendParams, error) {
	var v violations
	k := v.key(r.GetConsumer(), r.GetKind(), r.GetKey())
	pol := s.policyFor(ctx, k.Consumer)
	p := storage.ExtendParams{
		Key:           k,
		Token:         r.GetToken(),
		DefaultLease:  pol.Lease.Default,
		MaxLeaseTotal: pol.MaxLeaseTotal,
	}
	if r.GetLease() != nil { // unset: the record's own lease (storage.ExtendLease)
		p.Lease = v.duration("lease", r.GetLease(), pol.Lease, "lease", pol.Source)
	}
	v.fence(r.GetToken(), r.GetClaimSecret())
	return p, v.err()
}

func (s *Service) validatePark(r *idemregv1.ParkRequest) (storage.ParkParams, error) {
	var v violations
	p := storage.ParkParams{Key: v.key(r.GetConsumer(), r.GetKind(), r.GetKey()), Token: r.GetToken(), Reason: r.GetReason()}
	v.fence(r.GetToken(), r.GetClaimSecret())
	switch n := len(p.Reason); {
	case n == 0:
		v.add("reason", "required: why the outcome is unknown")
	case n > MaxParkReasonBytes:
		v.add("reason", "must be at most %d bytes, got %d", MaxParkReasonBytes, n)
	default:
		v.printable("reason", p.Reason)
	}
	return p, v.err()
}

func (s *Service) validateLookup(r *idemregv1.LookupRequest) (storage.Key, error) {
	var v violations
	k := v.key(r.GetConsumer(), r.GetKind(), r.GetKey())
	return k, v.err()
}
