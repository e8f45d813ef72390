package server_test

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/storage"
)

// echoStore answers every valid request without I/O: the fuzz targets
// test validation and result encoding, not a backend. Claim acquires,
// Complete keeps the encoded result and Lookup returns the last one kept
// (or stored, when set).
type echoStore struct {
	storage.Store
	result []byte
	stored []byte
}

func (s *echoStore) record(k storage.Key) storage.Record {
	return storage.Record{Key: k, State: storage.StateInProgress, Token: 7, Attempt: 1,
		CreatedAt: time.Unix(1, 0), LeaseExpiresAt: time.Unix(2, 0), ExpiresAt: time.Unix(3, 0)}
}

func (s *echoStore) Claim(_ context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	return storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: s.record(p.Key)}, nil
}

func (s *echoStore) Complete(_ context.Context, p storage.CompleteParams) (storage.Record, error) {
	r := s.record(p.Key)
	r.State, r.Result, r.CompletedAt = storage.StateCompleted, p.Result, time.Unix(2, 0)
	s.result = p.Result
	return r, nil
}

func (s *echoStore) Release(_ context.Context, p storage.ReleaseParams) (storage.Record, error) {
	return s.record(p.Key), nil
}

func (s *echoStore) Extend(_ context.Context, p storage.ExtendParams) (storage.Record, error) {
	return s.record(p.Key), nil
}

func (s *echoStore) Park(_ context.Context, p storage.ParkParams) (storage.Record, error) {
	r := s.record(p.Key)
	r.State, r.ParkReason = storage.StateParked, p.Reason
	return r, nil
}

// echoKey is the echo store's claim key, so that the fuzz targets can
// send the right claim secret with any token.
var echoKey = bytes.Repeat([]byte{0x5A}, storage.ClaimKeySize)

func (s *echoStore) ClaimKeyRing(context.Context) (storage.ClaimKeyRing, error) {
	return storage.ClaimKeyRing{Keys: []storage.ClaimKey{{Generation: 1, Key: echoKey}}}, nil
}

func (s *echoStore) RotateClaimKey(context.Context, storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	return s.ClaimKeyRing(context.Background())
}

// secretOf is what the holder of token for r's key would send, or a part
// of it.
func secretOf(r request) []byte {
	s := claimsecret.Derive(echoKey, storage.Key{Consumer: r.consumer, Kind: storage.Kind(r.kind), Key: r.key}, r.token)
	if r.shortSecret {
		return s[:r.token&0xF] // 0 to 15 bytes
	}
	return s
}

func (s *echoStore) Lookup(_ context.Context, k storage.Key) (storage.Record, error) {
	r := s.record(k)
	r.State, r.Result = storage.StateCompleted, s.result
	if s.stored != nil {
		r.Result = s.stored
	}
	return r, nil
}

// The echo store's storage.Admin: Resolve answers like Complete (or a
// release), List and CountParked find nothing.

func (s *echoStore) Inspect(_ context.Context, k storage.Key) (storage.InspectResult, error) {
	return storage.InspectResult{Record: s.record(k), Now: time.Unix(2, 0)}, nil
}

func (s *echoStore) Invalidate(_ context.Context, p storage.InvalidateParams) (storage.Record, error) {
	return s.record(p.Key), nil
}

func (s *echoStore) Resolve(_ context.Context, p storage.ResolveParams) (storage.Record, error) {
	r := s.record(p.Key)
	if p.Complete {
		r.State, r.Result, r.CompletedAt = storage.StateCompleted, p.Result, time.Unix(2, 0)
	}
	return r, nil
}

func (s *echoStore) List(context.Context, storage.ListParams) (storage.ListResult, error) {
	return storage.ListResult{Now: time.Unix(2, 0)}, nil
}

func (s *echoStore) CountParked(context.Context, string) (map[string]int64, error) {
	return map[string]int64{}, nil
}

// services are what the fuzz targets call: the registry and the admin
// service on one echo store.
type services struct {
	registry *server.Service
	admin    *server.AdminService
}

func newEchoService(t testing.TB) (services, *echoStore) {
	st := &echoStore{}
	svc, err := server.NewService(st, server.DefaultLimits(), nil)
	require.NoError(t, err)
	admin, err := server.NewAdminService(st, server.DefaultLimits())
	require.NoError(t, err)
	return services{registry: svc, admin: admin}, st
}

// request is one call to the service, for the fuzz targets.
type request struct {
	method           uint8
	consumer         string
	kind             idemregv1.Kind
	key              string
	fingerprint      []byte
	holder           string
	token            int64
	shortSecret      bool // send the claim secret cut short
	lease, retention *durationpb.Duration
	result           *idemregv1.Result
	// ResolveRecord: release, when set, is the resolution instead of
	// result (which, nil, leaves none). ListRecords: prefix, state,
	// pageSize and pageToken; token is its min_attempt and lease its
	// older_than.
	release   *bool
	prefix    bool
	state     int32
	pageSize  int32
	pageToken string
}

// Methods of request.method beyond the registry's.
const (
	methodResolve = 6
	methodList    = 7
	methodCount   = 8
	methods       = 9
)

// expectedViolations is the documented contract (docs/semantics.md,
// "Limits"), written out independently of validate.go: the fields r
// breaks, sorted.
func expectedViolations(r request) []string {
	var bad []string
	// A consumer, or the start of one: at most 128 bytes of [A-Za-z0-9._:/-].
	consumerPrefixOK := len(r.consumer) <= 128
	for _, c := range []byte(r.consumer) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || slices.Contains([]byte("._:/-"), c)) {
			consumerPrefixOK = false
		}
	}
	switch r.method {
	case methodCount:
		if !consumerPrefixOK {
			bad = append(bad, "consumer_prefix")
		}
		return bad
	case methodList:
		return expectedListViolations(r, consumerPrefixOK)
	}
	if r.consumer == "" || !consumerPrefixOK {
		bad = append(bad, "consumer")
	}
	if r.kind != idemregv1.Kind_KIND_MESSAGE && r.kind != idemregv1.Kind_KIND_OPERATION {
		bad = append(bad, "kind")
	}
	if r.key == "" || len(r.key) > 256 || !printable(r.key) {
		bad = append(bad, "key")
	}
	duration := func(field string, d *durationpb.Duration, lo, hi time.Duration) {
		if d == nil {
			return
		}
		if d.CheckValid() != nil || d.AsDuration() < lo || d.AsDuration() > hi {
			bad = append(bad, field)
		}
	}
	switch r.method {
	case 0: // Claim
		if len(r.fingerprint) > 64 {
			bad = append(bad, "fingerprint")
		}
		if len(r.holder) > 128 || !printable(r.holder) {
			bad = append(bad, "holder")
		}
		duration("lease", r.lease, time.Second, time.Hour)
		duration("retention", r.retention, time.Minute, 30*24*time.Hour)
	case 1: // Complete
		if r.shortSecret {
			bad = append(bad, "claim_secret")
		}
		if r.token <= 0 {
			bad = append(bad, "token")
		}
		bad = append(bad, expectedResultViolations(r.result)...)
	case methodResolve: // ResolveRecord, with holder as its reason
		if r.token <= 0 {
			bad = append(bad, "token")
		}
		if r.holder == "" || len(r.holder) > 256 || !printable(r.holder) {
			bad = append(bad, "reason")
		}
		switch {
		case r.release != nil:
			if !*r.release {
				bad = append(bad, "release")
			}
		case r.result == nil:
			bad = append(bad, "resolution")
		default:
			bad = append(bad, expectedResultViolations(r.result)...)
		}
	case 5: // Park, with holder as its reason
		if r.shortSecret {
			bad = append(bad, "claim_secret")
		}
		if r.token <= 0 {
			bad = append(bad, "token")
		}
		if r.holder == "" || len(r.holder) > 512 || !printable(r.holder) {
			bad = append(bad, "reason")
		}
	case 2, 3: // Release, Extend
		if r.shortSecret {
			bad = append(bad, "claim_secret")
		}
		if r.token <= 0 {
			bad = append(bad, "token")
		}
		if r.method == 3 {
			duration("lease", r.lease, time.Second, time.Hour)
		}
	}
	slices.Sort(bad)
	return slices.Compact(bad)
}

// printable is the contract of every stored text field: valid UTF-8 of
// letters, marks, numbers, punctuation, symbols, and the ASCII space (no
// other space, no control or format character, no NUL).
func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, c := range s {
		if !unicode.In(c, unicode.L, unicode.M, unicode.N, unicode.P, unicode.S) && c != ' ' {
			return false
		}
	}
	return true
}

// expectedResultViolations are the fields a result to store breaks, as
// Complete and ResolveRecord check it.
func expectedResultViolations(res *idemregv1.Result) []string {
	var bad []string
	switch o := res.GetOutcome().(type) {
	case nil:
		bad = append(bad, "result")
	case *idemregv1.Result_Response:
		if !printable(o.Response.GetType()) {
			bad = append(bad, "result.response.type")
		}
	case *idemregv1.Result_Failure:
		if c := o.Failure.GetCode(); c < 1 || c > 16 {
			bad = append(bad, "result.failure.code")
		}
		if !printable(o.Failure.GetMessage()) {
			bad = append(bad, "result.failure.message")
		}
	}
	if res.GetOutcome() != nil && proto.Size(res) > server.DefaultMaxResultBytes {
		bad = append(bad, "result")
	}
	return bad
}

// expectedListViolations are the fields of a ListRecords r breaks.
func expectedListViolations(r request, consumerPrefixOK bool) []string {
	var bad []string
	if !consumerPrefixOK || !r.prefix && r.consumer == "" {
		bad = append(bad, "consumer")
	}
	if r.state < 0 || r.state > 3 {
		bad = append(bad, "state")
	}
	if r.token < 0 {
		bad = append(bad, "min_attempt")
	}
	if d := r.lease; d != nil && (d.CheckValid() != nil || d.AsDuration() < 0 || d.AsDuration() > 10*365*24*time.Hour) {
		bad = append(bad, "older_than")
	}
	if r.pageSize < 0 || r.pageSize > 500 {
		bad = append(bad, "page_size")
	}
	// Its length is checked with the filters, the token itself once they
	// are valid; a fuzzed token is never one the server sealed.
	if len(r.pageToken) > 1024 || len(bad) == 0 && r.pageToken != "" {
		bad = append(bad, "page_token")
	}
	slices.Sort(bad)
	return bad
}

// call sends r to the services and returns the status.
func call(s services, r request) (*status.Status, *idemregv1.Record) {
	ctx := context.Background()
	svc := s.registry
	var (
		rec *idemregv1.Record
		err error
	)
	switch r.method {
	case 0:
		var res *idemregv1.ClaimResponse
		res, err = svc.Claim(ctx, &idemregv1.ClaimRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key,
			Fingerprint: r.fingerprint, Holder: r.holder, Lease: r.lease, Retention: r.retention})
		rec = res.GetRecord()
	case 1:
		var res *idemregv1.CompleteResponse
		res, err = svc.Complete(ctx, &idemregv1.CompleteRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key,
			Token: r.token, ClaimSecret: secretOf(r), Result: r.result})
		rec = res.GetRecord()
	case 2:
		var res *idemregv1.ReleaseResponse
		res, err = svc.Release(ctx, &idemregv1.ReleaseRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key, Token: r.token, ClaimSecret: secretOf(r)})
		rec = res.GetRecord()
	case 3:
		var res *idemregv1.ExtendResponse
		res, err = svc.Extend(ctx, &idemregv1.ExtendRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key,
			Token: r.token, ClaimSecret: secretOf(r), Lease: r.lease})
		rec = res.GetRecord()
	case 5:
		var res *idemregv1.ParkResponse
		res, err = svc.Park(ctx, &idemregv1.ParkRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key,
			Token: r.token, ClaimSecret: secretOf(r), Reason: r.holder})
		rec = res.GetRecord()
	case methodResolve:
		req := &idemregv1.ResolveRecordRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key, Token: r.token, Reason: r.holder}
		switch {
		case r.release != nil:
			req.Resolution = &idemregv1.ResolveRecordRequest_Release{Release: *r.release}
		case r.result != nil:
			req.Resolution = &idemregv1.ResolveRecordRequest_Result{Result: r.result}
		}
		var res *idemregv1.ResolveRecordResponse
		res, err = s.admin.ResolveRecord(server.AsAnonymous(ctx), req)
		rec = res.GetRecord()
	case methodList:
		_, err = s.admin.ListRecords(server.AsAnonymous(ctx), &idemregv1.ListRecordsRequest{Consumer: r.consumer, ConsumerPrefix: r.prefix,
			State: idemregv1.State(r.state), MinAttempt: r.token, OlderThan: r.lease, PageSize: r.pageSize, PageToken: r.pageToken})
	case methodCount:
		_, err = s.admin.CountParked(server.AsAnonymous(ctx), &idemregv1.CountParkedRequest{ConsumerPrefix: r.consumer})
	default:
		var res *idemregv1.LookupResponse
		res, err = svc.Lookup(ctx, &idemregv1.LookupRequest{Consumer: r.consumer, Kind: r.kind, Key: r.key})
		rec = res.GetRecord()
	}
	return status.Convert(err), rec
}

// requireInvalidArgument checks that st is INVALID_ARGUMENT with the
// registry's ErrorInfo and a BadRequest naming exactly the fields want.
func requireInvalidArgument(t testing.TB, st *status.Status, want []string) {
	t.Helper()
	require.Equal(t, codes.InvalidArgument, st.Code(), "%v; expected violations of %v", st.Message(), want)
	var (
		info   *errdetails.ErrorInfo
		fields []string
	)
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			info = d
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				require.NotEmpty(t, v.GetDescription(), "field %s", v.GetField())
				fields = append(fields, v.GetField())
			}
		}
	}
	require.NotNil(t, info, "ErrorInfo")
	require.Equal(t, idemregv1.ReasonInvalidArgument, info.GetReason())
	require.Equal(t, idemregv1.ErrorDomain, info.GetDomain())
	slices.Sort(fields)
	require.Equal(t, want, slices.Compact(fields), "field violations")
}

// FuzzValidation sends requests built from fuzzed fields to the service
// and holds every answer to the documented limits: an invalid request is
// INVALID_ARGUMENT with a field violation for each invalid field, and
// nothing else; a valid one reaches the store. Nothing panics.
func FuzzValidation(f *testing.F) {
	f.Add(uint8(0), "billing.worker", int32(1), "m-1", []byte("fp"), "host-1", int64(0), int64(30), int32(0), int64(3600), int32(0), uint8(3), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(1), "billing.worker", int32(2), "op-1", []byte(nil), "", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(1), "payments.v1.Charge", []byte("charged"), int32(0), "")
	f.Add(uint8(1), "billing.worker", int32(2), "op-1", []byte(nil), "", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(2), "", []byte(nil), int32(9), "card declined")
	f.Add(uint8(3), "a", int32(1), "k", []byte(nil), "", int64(1), int64(3600), int32(0), int64(0), int32(0), uint8(1), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(4), "x", int32(1), "k", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(0), "bad consumer", int32(0), "", make([]byte, 65), "\xff", int64(0), int64(-1), int32(0), int64(60), int32(-5), uint8(3), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(2), "", int32(7), "\xc3\x28", []byte(nil), "", int64(-3), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(1), "c", int32(1), "tab\tkey", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(2), "", []byte(nil), int32(0), "\xfe")
	f.Add(uint8(0), "c", int32(1), "k", []byte(nil), "", int64(0), int64(315576000001), int32(0), int64(0), int32(1e9), uint8(3), uint8(0), "", []byte(nil), int32(0), "")

	f.Add(uint8(5), "billing.worker", int32(2), "op-1", []byte(nil), "sent, no answer", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(5), "billing.worker", int32(2), "op-1", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(4), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(5), "c", int32(1), "k", []byte(nil), "line\nbreak", int64(3), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")

	// ResolveRecord: a result, a release, none; an invalid reason and token.
	f.Add(uint8(6), "billing.worker", int32(2), "op-1", []byte(nil), "checked the provider", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(1), "payments.v1.Charge", []byte("charged"), int32(0), "")
	f.Add(uint8(6), "billing.worker", int32(2), "op-1", []byte(nil), "fixed", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(24), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(6), "billing.worker", int32(2), "op-1", []byte(nil), "fixed", int64(7), int64(0), int32(0), int64(0), int32(0), uint8(8), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(6), "c", int32(1), "k", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(6), "c", int32(1), "k", []byte(nil), "tab\there", int64(3), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(2), "", []byte(nil), int32(0), "declined")
	// ListRecords: by consumer, by prefix (every consumer), bad filters, a garbled token.
	f.Add(uint8(7), "billing.worker", int32(0), "", []byte(nil), "", int64(2), int64(3600), int32(0), int64(0), int32(50), uint8(1), uint8(0), "", []byte(nil), int32(3), "")
	f.Add(uint8(7), "", int32(0), "", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(8), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(7), "", int32(0), "", []byte(nil), "", int64(-1), int64(-5), int32(0), int64(0), int32(501), uint8(1), uint8(0), "", []byte(nil), int32(9), "")
	f.Add(uint8(7), "billing.", int32(0), "", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(10), uint8(8), uint8(0), "", []byte(nil), int32(0), "AQID")
	// CountParked.
	f.Add(uint8(8), "billing.", int32(0), "", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")
	f.Add(uint8(8), "bill ing", int32(0), "", []byte(nil), "", int64(0), int64(0), int32(0), int64(0), int32(0), uint8(0), uint8(0), "", []byte(nil), int32(0), "")

	svc, _ := newEchoService(f)
	f.Fuzz(func(t *testing.T, method uint8, consumer string, kind int32, key string, fingerprint []byte, holder string,
		token, leaseSec int64, leaseNanos int32, retSec int64, retNanos int32, durations, resultKind uint8,
		typ string, data []byte, code int32, message string) {
		r := request{method: method % methods, consumer: consumer, kind: idemregv1.Kind(kind), key: key,
			fingerprint: fingerprint, holder: holder, token: token}
		if durations&1 != 0 {
			r.lease = &durationpb.Duration{Seconds: leaseSec, Nanos: leaseNanos}
		}
		if durations&2 != 0 {
			r.retention = &durationpb.Duration{Seconds: retSec, Nanos: retNanos}
		}
		r.shortSecret = durations&4 != 0
		switch resultKind % 4 {
		case 1:
			r.result = &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: typ, Data: data}}}
		case 2:
			r.result = &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: code, Message: message, Details: [][]byte{data}}}}
		case 3:
			r.result = &idemregv1.Result{}
		}
		if r.method == methodResolve && durations&8 != 0 {
			release := durations&16 != 0
			r.release = &release
		}
		if r.method == methodList {
			r.prefix, r.state, r.pageSize, r.pageToken = durations&8 != 0, code, retNanos, message
		}
		want := expectedViolations(r)
		st, rec := call(svc, r)
		if len(want) > 0 {
			requireInvalidArgument(t, st, want)
			return
		}
		require.Equal(t, codes.OK, st.Code(), "a valid request: %v", st.Message())
		if r.method == methodList || r.method == methodCount {
			return // nothing listed or counted by the echo store
		}
		require.Equal(t, key, rec.GetKey())
		if r.method == 1 || r.method == methodResolve && r.release == nil {
			require.True(t, proto.Equal(r.result, rec.GetResult()), "the result comes back as it was sent")
		}
	})
}

// FuzzResultEncoding sends arbitrary encoded results through Complete and
// Lookup: one the API accepts comes back equal to what was sent, and a
// stored result that does not decode is INTERNAL, never a panic.
func FuzzResultEncoding(f *testing.F) {
	for _, r := range []*idemregv1.Result{
		{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "payments.v1.Charge", Data: []byte("charge-1")}}},
		{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: 9, Message: "declined", Details: [][]byte{{0x0a, 0x01, 'x'}}}}},
		{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "\xff\xfe", Data: nil}}},
		{},
	} {
		b, err := proto.Marshal(r)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{0x0a, 0x80}) // truncated
	f.Add([]byte{0x12, 0x02, 0x08, 0x00})
	f.Add([]byte{0xfa, 0xff, 0xff, 0xff, 0x0f, 0x00}) // unknown field

	svc, st := newEchoService(f)
	f.Fuzz(func(t *testing.T, raw []byte) {
		k := request{consumer: "fuzz", kind: idemregv1.Kind_KIND_OPERATION, key: "k", token: 1, method: 1}

		// Stored bytes the service did not write (a corrupt row) decode or
		// fail with INTERNAL.
		st.stored = raw
		got, rec := call(svc, request{consumer: k.consumer, kind: k.kind, key: k.key, method: 4})
		st.stored = nil
		var res idemregv1.Result
		decodes := proto.Unmarshal(raw, &res) == nil
		if decodes {
			require.Equal(t, codes.OK, got.Code(), got.Message())
			require.True(t, proto.Equal(&res, rec.GetResult()) || len(raw) == 0)
		} else {
			require.Equal(t, codes.Internal, got.Code())
			require.NotContains(t, got.Message(), "proto", "decoding errors stay in the logs")
			return
		}

		k.result = &res
		want := expectedViolations(k)
		got, rec = call(svc, k)
		if len(want) > 0 {
			requireInvalidArgument(t, got, want)
			return
		}
		require.Equal(t, codes.OK, got.Code(), got.Message())
		require.True(t, proto.Equal(&res, rec.GetResult()), "Complete returns the result it stored")
		// The encoding is deterministic: the same result encodes the same way again.
		again, err := proto.MarshalOptions{Deterministic: true}.Marshal(rec.GetResult())
		require.NoError(t, err)
		require.Equal(t, st.result, again)
		got, rec = call(svc, request{consumer: k.consumer, kind: k.kind, key: k.key, method: 4})
		require.Equal(t, codes.OK, got.Code())
		require.True(t, proto.Equal(&res, rec.GetResult()), "Lookup replays the stored result")
	})
}
