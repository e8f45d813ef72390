package server_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// backends are the stores every server test runs on.
var backends = []struct {
	name string
	open func(t *testing.T, clock *storagetest.Clock) storage.Store
}{
	{"postgres", func(t *testing.T, clock *storagetest.Clock) storage.Store {
		s, err := postgres.Open(t.Context(), pgtest.NewDatabase(t), postgres.WithClockOffset(clock.Offset))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}},
	{"pebble", func(t *testing.T, clock *storagetest.Clock) storage.Store {
		s, err := pebble.Open(t.TempDir(), pebble.WithClock(clock.Now))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}},
}

// harness is a real gRPC server on a loopback listener and a client
// connected to it.
type harness struct {
	clock  *storagetest.Clock
	client idemregv1.RegistryServiceClient
	conn   *grpc.ClientConn
}

func start(t *testing.T, store storage.Store, cfg server.Config) *grpc.ClientConn {
	t.Helper()
	return servertest.Start(t, store, cfg)
}

func forEachBackend(t *testing.T, fn func(t *testing.T, h *harness)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			clock := &storagetest.Clock{}
			conn := start(t, b.open(t, clock), server.Config{})
			fn(t, &harness{clock: clock, client: idemregv1.NewRegistryServiceClient(conn), conn: conn})
		})
	}
}

func claimReq(key, fp string) *idemregv1.ClaimRequest {
	return &idemregv1.ClaimRequest{
		Consumer:    "billing.payment-worker",
		Kind:        idemregv1.Kind_KIND_OPERATION,
		Key:         key,
		Fingerprint: []byte(fp),
		Lease:       durationpb.New(10 * time.Second),
		Holder:      "pod-a",
	}
}

// forged is a claim secret of the right size that proves no claim.
var forged = bytes.Repeat([]byte{0xA5}, server.ClaimSecretSize)

func response(data string) *idemregv1.Result {
	return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "test.Reply", Data: []byte(data)}}}
}

// requireStatus checks the code and the ErrorInfo reason of err and returns
// the status for further checks.
func requireStatus(t *testing.T, err error, code codes.Code, reason string) *status.Status {
	t.Helper()
	require.Error(t, err)
	st := status.Convert(err)
	require.Equal(t, code, st.Code(), "message: %s", st.Message())
	var info *errdetails.ErrorInfo
	for _, d := range st.Details() {
		if i, ok := d.(*errdetails.ErrorInfo); ok {
			info = i
		}
	}
	require.NotNil(t, info, "status carries no ErrorInfo")
	require.Equal(t, idemregv1.ErrorDomain, info.GetDomain())
	require.Equal(t, reason, info.GetReason())
	return st
}

func TestSemanticsTable(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client

		// none → ACQUIRED, attempt 1
		first, err := c.Claim(ctx, claimReq("pay-1", "fp-1"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, first.GetOutcome())
		require.Positive(t, first.GetToken())
		require.Equal(t, first.GetToken(), first.GetRecord().GetToken())
		require.EqualValues(t, 1, first.GetRecord().GetAttempt())
		require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, first.GetRecord().GetState())
		require.Equal(t, 24*time.Hour, first.GetRecord().GetExpiresAt().AsTime().Sub(first.GetRecord().GetLeaseExpiresAt().AsTime()),
			"an operation key gets the default operation retention")

		// in progress, lease live → IN_PROGRESS with retry_after, token withheld
		busy, err := c.Claim(ctx, claimReq("pay-1", "fp-1"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, busy.GetOutcome())
		require.Zero(t, busy.GetToken())
		require.Zero(t, busy.GetRecord().GetToken(), "another holder's token is never handed out")
		require.Positive(t, busy.GetRetryAfter().AsDuration())
		require.LessOrEqual(t, busy.GetRetryAfter().AsDuration(), 10*time.Second)

		// in progress, different fingerprint → FINGERPRINT_MISMATCH
		_, err = c.Claim(ctx, claimReq("pay-1", "fp-2"))
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)

		// in progress, lease expired → takeover with a new token, attempt 2
		h.clock.Advance(11 * time.Second)
		_, err = c.Claim(ctx, claimReq("pay-1", "fp-2"))
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)
		second, err := c.Claim(ctx, claimReq("pay-1", "fp-1"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, second.GetOutcome())
		require.Greater(t, second.GetToken(), first.GetToken())
		require.EqualValues(t, 2, second.GetRecord().GetAttempt())

		// the stale holder cannot complete; the new one can
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("stale")})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
		done, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1", Token: second.GetToken(), ClaimSecret: second.GetClaimSecret(), Result: response("charged")})
		require.NoError(t, err)
		require.Equal(t, idemregv1.State_STATE_COMPLETED, done.GetRecord().GetState())
		require.NotNil(t, done.GetRecord().GetCompletedAt())

		// completed → COMPLETED with the stored result (a replay)
		replay, err := c.Claim(ctx, claimReq("pay-1", ""))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
		require.Equal(t, "charged", string(replay.GetRecord().GetResult().GetResponse().GetData()))
		require.Equal(t, "test.Reply", replay.GetRecord().GetResult().GetResponse().GetType())

		// completed, different fingerprint → FINGERPRINT_MISMATCH
		_, err = c.Claim(ctx, claimReq("pay-1", "fp-2"))
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)

		// expired → ACQUIRED again, attempt 1, any fingerprint
		h.clock.Advance(25 * time.Hour)
		_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1"})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
		third, err := c.Claim(ctx, claimReq("pay-1", "fp-2"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, third.GetOutcome())
		require.Greater(t, third.GetToken(), second.GetToken())
		require.EqualValues(t, 1, third.GetRecord().GetAttempt())
	})
}

// TestRepeatedClaim: a Claim repeated with its request_id after a lost
// reply gets its token back; nobody else does, and Lookup never shows the id.
func TestRepeatedClaim(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client
		req := claimReq("pay-r", "fp-1")
		req.RequestId = "7f1c2a9e-0b1d-4c6e-9a51-3d2f8e6b4a10"
		first, err := c.Claim(ctx, req)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, first.GetOutcome())

		again, err := c.Claim(ctx, req)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
		require.Equal(t, first.GetToken(), again.GetToken())
		require.True(t, proto.Equal(first.GetRecord(), again.GetRecord()), "the same answer: %v, then %v", first.GetRecord(), again.GetRecord())

		other := claimReq("pay-r", "fp-1")
		other.RequestId = "another-claim"
		busy, err := c.Claim(ctx, other)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, busy.GetOutcome())
		require.Zero(t, busy.GetToken())

		looked, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-r"})
		require.NoError(t, err)
		wire, err := proto.Marshal(looked)
		require.NoError(t, err)
		require.NotContains(t, string(wire), req.RequestId, "the request id is never handed out")
	})
}

func TestFencedCalls(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client
		const consumer = "orders.inbox"
		kind := idemregv1.Kind_KIND_MESSAGE
		claim := &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: "msg-1"}

		// Without the claim's secret nothing is fenced in, whether or not
		// the record exists: the answer says the secret is not the
		// claim's, never that another holder took over.
		_, err := c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: 5, ClaimSecret: forged})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: 5, ClaimSecret: forged})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: 5, ClaimSecret: forged, Result: response("x")})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)

		// A real claim's holder finds its record gone once it expired.
		gone := &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: "msg-0", Lease: durationpb.New(time.Second), Retention: durationpb.New(time.Hour)}
		old, err := c.Claim(ctx, gone)
		require.NoError(t, err)
		h.clock.Advance(2 * time.Hour)
		_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: kind, Key: "msg-0", Token: old.GetToken(), ClaimSecret: old.GetClaimSecret()})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
		_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "msg-0", Token: old.GetToken(), ClaimSecret: old.GetClaimSecret()})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: "msg-0", Token: old.GetToken(), ClaimSecret: old.GetClaimSecret(), Result: response("x")})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

		got, err := c.Claim(ctx, claim)
		require.NoError(t, err)
		require.Equal(t, 7*24*time.Hour+30*time.Second, got.GetRecord().GetExpiresAt().AsTime().Sub(got.GetRecord().GetCreatedAt().AsTime()),
			"defaults: 30s lease, 7 days retention for messages")

		ext, err := c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: got.GetToken(), ClaimSecret: got.GetClaimSecret(), Lease: durationpb.New(time.Minute)})
		require.NoError(t, err)
		require.Equal(t, got.GetToken(), ext.GetRecord().GetToken())
		require.True(t, ext.GetRecord().GetLeaseExpiresAt().AsTime().After(got.GetRecord().GetLeaseExpiresAt().AsTime()))

		lookup, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: "msg-1"})
		require.NoError(t, err)
		require.Zero(t, lookup.GetRecord().GetToken(), "Lookup withholds a live claim's token")
		require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, lookup.GetRecord().GetState())

		_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: got.GetToken(), ClaimSecret: got.GetClaimSecret()})
		require.NoError(t, err)
		again, err := c.Claim(ctx, claim)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome(), "a released key is acquired at once")

		_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: got.GetToken(), ClaimSecret: got.GetClaimSecret()})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)

		failure := &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: int32(codes.FailedPrecondition), Message: "card declined"}}}
		done, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: again.GetToken(), ClaimSecret: again.GetClaimSecret(), Result: failure})
		require.NoError(t, err)
		repeat, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: again.GetToken(), ClaimSecret: again.GetClaimSecret(), Result: response("other")})
		require.NoError(t, err, "repeating a Complete is safe")
		require.Equal(t, "card declined", repeat.GetRecord().GetResult().GetFailure().GetMessage())
		require.Equal(t, done.GetRecord().GetCompletedAt().AsTime(), repeat.GetRecord().GetCompletedAt().AsTime())

		_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: again.GetToken(), ClaimSecret: again.GetClaimSecret()})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonAlreadyCompleted)
		_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "msg-1", Token: again.GetToken(), ClaimSecret: again.GetClaimSecret()})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonAlreadyCompleted)

		replay, err := c.Claim(ctx, claim)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
		require.EqualValues(t, codes.FailedPrecondition, replay.GetRecord().GetResult().GetFailure().GetCode())
	})
}

func TestValidation(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client
		ok := func() *idemregv1.ClaimRequest { return claimReq("valid-key", "fp") }
		cases := []struct {
			name  string
			req   *idemregv1.ClaimRequest
			field string
		}{
			{"empty consumer", func() *idemregv1.ClaimRequest { r := ok(); r.Consumer = ""; return r }(), "consumer"},
			{"consumer too long", func() *idemregv1.ClaimRequest { r := ok(); r.Consumer = strings.Repeat("a", 129); return r }(), "consumer"},
			{"consumer bad byte", func() *idemregv1.ClaimRequest { r := ok(); r.Consumer = "billing worker"; return r }(), "consumer"},
			{"kind unspecified", func() *idemregv1.ClaimRequest { r := ok(); r.Kind = idemregv1.Kind_KIND_UNSPECIFIED; return r }(), "kind"},
			{"kind unknown", func() *idemregv1.ClaimRequest { r := ok(); r.Kind = 7; return r }(), "kind"},
			{"empty key", func() *idemregv1.ClaimRequest { r := ok(); r.Key = ""; return r }(), "key"},
			{"key too long", func() *idemregv1.ClaimRequest { r := ok(); r.Key = strings.Repeat("k", 257); return r }(), "key"},
			{"key not printable", func() *idemregv1.ClaimRequest { r := ok(); r.Key = "a\x00b"; return r }(), "key"},
			{"fingerprint too long", func() *idemregv1.ClaimRequest { r := ok(); r.Fingerprint = make([]byte, 65); return r }(), "fingerprint"},
			{"lease too short", func() *idemregv1.ClaimRequest { r := ok(); r.Lease = durationpb.New(time.Millisecond); return r }(), "lease"},
			{"lease too long", func() *idemregv1.ClaimRequest { r := ok(); r.Lease = durationpb.New(2 * time.Hour); return r }(), "lease"},
			{"lease negative", func() *idemregv1.ClaimRequest { r := ok(); r.Lease = durationpb.New(-time.Second); return r }(), "lease"},
			{"lease invalid", func() *idemregv1.ClaimRequest {
				r := ok()
				r.Lease = &durationpb.Duration{Seconds: 1, Nanos: -1}
				return r
			}(), "lease"},
			{"retention too short", func() *idemregv1.ClaimRequest { r := ok(); r.Retention = durationpb.New(time.Second); return r }(), "retention"},
			{"retention too long", func() *idemregv1.ClaimRequest { r := ok(); r.Retention = durationpb.New(31 * 24 * time.Hour); return r }(), "retention"},
			{"holder too long", func() *idemregv1.ClaimRequest { r := ok(); r.Holder = strings.Repeat("h", 129); return r }(), "holder"},
			{"request_id too long", func() *idemregv1.ClaimRequest { r := ok(); r.RequestId = strings.Repeat("r", 129); return r }(), "request_id"},
			{"request_id with a space", func() *idemregv1.ClaimRequest { r := ok(); r.RequestId = "req 1"; return r }(), "request_id"},
			{"request_id not ASCII", func() *idemregv1.ClaimRequest { r := ok(); r.RequestId = "req-é"; return r }(), "request_id"},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				_, err := c.Claim(ctx, tc.req)
				st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
				require.Contains(t, violatedFields(st), tc.field)
			})
		}

		// Limits are inclusive.
		edge := ok()
		edge.Consumer = strings.Repeat("c", 128)
		edge.Key = strings.Repeat("é", 128) // 256 bytes
		edge.Fingerprint = make([]byte, 64)
		edge.Lease = durationpb.New(time.Hour)
		edge.Retention = durationpb.New(30 * 24 * time.Hour)
		res, err := c.Claim(ctx, edge)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())

		// Several bad fields are all reported.
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Kind: idemregv1.Kind_KIND_MESSAGE})
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.ElementsMatch(t, []string{"consumer", "key", "token", "claim_secret", "result"}, violatedFields(st))

		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k", Token: 1, ClaimSecret: forged,
			Result: &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: 0}}}})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"result.failure.code"}, violatedFields(st))

		_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "\xff"})
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"key"}, violatedFields(st))

		// Nothing stored changed.
		got, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: edge.Consumer, Kind: edge.Kind, Key: edge.Key})
		require.NoError(t, err)
		require.EqualValues(t, 1, got.GetRecord().GetAttempt())
	})
}

func violatedFields(st *status.Status) []string {
	var fields []string
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				fields = append(fields, v.GetField())
			}
		}
	}
	return fields
}

func TestResultSizeLimit(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		c := h.client
		claim := func(key string) *idemregv1.ClaimResponse {
			res, err := c.Claim(ctx, claimReq(key, ""))
			require.NoError(t, err)
			return res
		}
		// The largest result that fits in 1 MiB once encoded.
		data := strings.Repeat("d", server.DefaultMaxResultBytes)
		for proto.Size(response(data)) > server.DefaultMaxResultBytes {
			data = data[1:]
		}
		cl := claim("big")
		done, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "big", Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response(data)})
		require.NoError(t, err)
		require.Len(t, done.GetRecord().GetResult().GetResponse().GetData(), len(data))

		cl = claim("too-big")
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "too-big", Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response(data + "xx")})
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"result"}, violatedFields(st))
		got, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "too-big"})
		require.NoError(t, err)
		require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, got.GetRecord().GetState(), "a rejected Complete changes nothing")
	})
}

func TestHealthAndReflection(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		hc := healthpb.NewHealthClient(h.conn)
		require.Eventually(t, func() bool {
			res, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "idemreg.v1.RegistryService"})
			return err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING
		}, 5*time.Second, 10*time.Millisecond)

		rc := reflectionpb.NewServerReflectionClient(h.conn)
		stream, err := rc.ServerReflectionInfo(t.Context())
		require.NoError(t, err)
		require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
		res, err := stream.Recv()
		require.NoError(t, err)
		var names []string
		for _, s := range res.GetListServicesResponse().GetService() {
			names = append(names, s.GetName())
		}
		require.Contains(t, names, "idemreg.v1.RegistryService")
		require.Contains(t, names, "grpc.health.v1.Health")
	})
}

// TestStoreDown points the server at a database that does not answer: health
// says NOT_SERVING and RPCs fail fast with UNAVAILABLE and RetryInfo, never
// leaking the driver's words.
func TestStoreDown(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close()) // nothing listens there now
	store, err := postgres.Open(t.Context(), "postgres://postgres@"+addr+"/idemreg?sslmode=disable&connect_timeout=1")
	require.NoError(t, err, "Open must not fail when the database is down: the service starts and reports NOT_SERVING")
	t.Cleanup(func() { _ = store.Close() })
	conn := start(t, store, server.Config{HealthInterval: 50 * time.Millisecond})

	hc := healthpb.NewHealthClient(conn)
	res, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, res.GetStatus())

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = idemregv1.NewRegistryServiceClient(conn).Claim(ctx, claimReq("k", ""))
	st := requireStatus(t, err, codes.Unavailable, idemregv1.ReasonStoreUnavailable)
	require.NotContains(t, st.Message(), "dial")
	require.NotContains(t, st.Message(), addr)
	var retry *errdetails.RetryInfo
	for _, d := range st.Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			retry = r
		}
	}
	require.NotNil(t, retry)
	require.Positive(t, retry.GetRetryDelay().AsDuration())
}

// TestPolicy serves with a policy file: a consumer's Claims get its
// defaults and are held to its bounds, whose violation names the bound and
// the policy; a reload applies to the next request.
func TestPolicy(t *testing.T) {
	const day = 24 * time.Hour
	path := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	write(`
consumers:
  - prefix: orders.
    message_retention: {min: 8d, default: 10d}
    lease: {default: 2m}
  - name: billing.payment-worker
    operation_retention: {max: 2d}
`)
	src, err := configfile.Open(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	c := idemregv1.NewRegistryServiceClient(start(t, store, server.Config{File: src}))
	ctx := t.Context()

	retentionOf := func(r *idemregv1.Record) time.Duration {
		return r.GetExpiresAt().AsTime().Sub(r.GetLeaseExpiresAt().AsTime())
	}
	leaseOf := func(r *idemregv1.Record) time.Duration {
		return r.GetLeaseExpiresAt().AsTime().Sub(r.GetCreatedAt().AsTime())
	}
	msg := func(consumer, key string, retention time.Duration) *idemregv1.ClaimRequest {
		r := &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key}
		if retention > 0 {
			r.Retention = durationpb.New(retention)
		}
		return r
	}

	// Defaults of the matching policy.
	res, err := c.Claim(ctx, msg("orders.inbox", "m-1", 0))
	require.NoError(t, err)
	require.Equal(t, 10*day, retentionOf(res.GetRecord()), "the prefix's default retention")
	require.Equal(t, 2*time.Minute, leaseOf(res.GetRecord()), "the prefix's default lease")
	ext, err := c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "orders.inbox", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1", Token: res.GetToken(), ClaimSecret: res.GetClaimSecret()})
	require.NoError(t, err)
	extended := ext.GetRecord().GetLeaseExpiresAt().AsTime().Sub(res.GetRecord().GetCreatedAt().AsTime())
	require.GreaterOrEqual(t, extended, 2*time.Minute, "an Extend without a lease extends by the claimed lease, here the prefix's default")
	require.Less(t, extended, 2*time.Minute+time.Minute)
	short := msg("orders.inbox", "m-3", 0)
	short.Lease = durationpb.New(90 * time.Second)
	res, err = c.Claim(ctx, short)
	require.NoError(t, err)
	ext, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "orders.inbox", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-3", Token: res.GetToken(), ClaimSecret: res.GetClaimSecret()})
	require.NoError(t, err)
	extended = ext.GetRecord().GetLeaseExpiresAt().AsTime().Sub(res.GetRecord().GetCreatedAt().AsTime())
	require.GreaterOrEqual(t, extended, 90*time.Second, "an Extend without a lease extends by the lease the key was claimed with")
	require.Less(t, extended, 2*time.Minute, "not by the default")
	res, err = c.Claim(ctx, msg("payments.inbox", "m-1", 0))
	require.NoError(t, err)
	require.Equal(t, 7*day, retentionOf(res.GetRecord()), "no match: the server's defaults")

	// Bounds, inclusive, named in the violation.
	res, err = c.Claim(ctx, msg("orders.inbox", "m-2", 8*day))
	require.NoError(t, err)
	require.Equal(t, 8*day, retentionOf(res.GetRecord()))
	_, err = c.Claim(ctx, msg("orders.inbox", "m-3", 8*day-time.Second))
	st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Equal(t, []string{"retention"}, violatedFields(st))
	require.Contains(t, st.Message(), `must be at least 8d (message_retention.min of prefix "orders."), got 191h59m59s`)
	_, err = c.Claim(ctx, msg("payments.inbox", "m-3", 31*day))
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Contains(t, st.Message(), `must be at most 30d (message_retention.max of the server defaults)`)
	_, err = c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "op-1", Retention: durationpb.New(3 * day)})
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
	require.Contains(t, st.Message(), `must be at most 2d (operation_retention.max of consumer "billing.payment-worker")`)
	res, err = c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1", Retention: durationpb.New(3 * day)})
	require.NoError(t, err, "the bound is the kind's own")
	require.Equal(t, 3*day, retentionOf(res.GetRecord()))

	// A reload applies to the next request; an invalid file changes nothing.
	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 2h}\n")
	_, err = src.Reload()
	require.NoError(t, err)
	res, err = c.Claim(ctx, msg("orders.inbox", "m-4", 0))
	require.NoError(t, err)
	require.Equal(t, 2*time.Hour, retentionOf(res.GetRecord()))
	require.Equal(t, server.DefaultLease, leaseOf(res.GetRecord()), "a field the new file leaves out is the server's again")
	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 3h, default: 2h}\n")
	_, err = src.Reload()
	require.ErrorContains(t, err, "message_retention.default 2h0m0s is below message_retention.min 3h0m0s")
	res, err = c.Claim(ctx, msg("orders.inbox", "m-5", 0))
	require.NoError(t, err)
	require.Equal(t, 2*time.Hour, retentionOf(res.GetRecord()), "the old policy stays in force")
}
