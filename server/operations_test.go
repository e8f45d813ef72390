package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
)

// syncBuffer collects logs written from the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
	// wrote is closed and replaced at each write, for waitLines.
	wrote chan struct{}
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.wrote != nil {
		close(s.wrote)
		s.wrote = nil
	}
	return s.b.Write(p)
}

// written returns a channel closed at the next write.
func (s *syncBuffer) written() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.wrote == nil {
		s.wrote = make(chan struct{})
	}
	return s.wrote
}

// waitLines returns the lines whose msg is msg once there are at least n.
// The access log writes a call's line when gRPC reports the call ended,
// after the status is on the wire: the caller can have its answer first.
func (s *syncBuffer) waitLines(t *testing.T, msg string, n int) []map[string]any {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		wrote := s.written()
		if lines := s.lines(t, msg); len(lines) >= n {
			return lines
		}
		select {
		case <-wrote:
		case <-timeout:
			t.Fatalf("%d lines %q after 10s, want %d", len(s.lines(t, msg)), msg, n)
		}
	}
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// lines decodes the JSON log lines whose msg is msg.
func (s *syncBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(s.String()), "\n") {
		if line == "" { // nothing logged yet
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// TestLogsAtWarn: with the level at WARN, calls that succeed leave no line
// and refusals still do.
func TestLogsAtWarn(t *testing.T) {
	var buf syncBuffer
	logger := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	conn := start(t, memStore(t), server.Config{Logger: logger})
	c := idemregv1.NewRegistryServiceClient(conn)
	ctx := t.Context()
	_, err := c.Claim(ctx, claimReq("warn-1", "fp-1"))
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("warn-1", "fp-2"))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)
	calls := buf.waitLines(t, "finished call", 1)
	require.Len(t, calls, 1)
	require.Equal(t, "FAILED_PRECONDITION", calls[0]["grpc.code"])
}

func jsonLogger(buf *syncBuffer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func detail[T any](t testing.TB, err error) T {
	t.Helper()
	var zero T
	for _, d := range statusOf(err).Details() {
		if v, ok := d.(T); ok {
			return v
		}
	}
	t.Fatalf("status %v carries no %T", err, zero)
	return zero
}

func TestRateLimit(t *testing.T) {
	src := accessFile(t, `
rate_limits:
  - consumers: ["limited.*"]
    rate: 0.5
    burst: 2
`)
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src}))
	lookup := func(consumer string) error {
		_, err := c.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
		return err
	}
	for range 2 {
		requireStatus(t, lookup("limited.a"), codes.NotFound, idemregv1.ReasonNotFound)
	}
	err := lookup("limited.a")
	st := requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonRateLimited)
	require.Contains(t, st.Message(), `consumer "limited.a" is over its rate limit of 0.5 requests per second, burst 2 (rate_limits "limited.*")`)
	qf := detail[*errdetails.QuotaFailure](t, err)
	require.Equal(t, "consumer:limited.a", qf.GetViolations()[0].GetSubject())
	delay := detail[*errdetails.RetryInfo](t, err).GetRetryDelay().AsDuration()
	require.Greater(t, delay, time.Second)
	require.LessOrEqual(t, delay, 2*time.Second)

	requireStatus(t, lookup("limited.b"), codes.NotFound, idemregv1.ReasonNotFound)
	requireStatus(t, lookup("unlimited"), codes.NotFound, idemregv1.ReasonNotFound)
}

// gateStore holds every Claim until its context ends or the gate opens.
type gateStore struct {
	storage.Store
	entered chan struct{}
	gate    chan struct{}
}

func (g *gateStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	g.entered <- struct{}{}
	select {
	case <-ctx.Done():
		return storage.ClaimResult{}, ctx.Err()
	case <-g.gate:
		return g.Store.Claim(ctx, p)
	}
}

func TestOverloadFailsFast(t *testing.T) {
	g := &gateStore{Store: memStore(t), entered: make(chan struct{}, 10), gate: make(chan struct{})}
	c := idemregv1.NewRegistryServiceClient(start(t, g, server.Config{MaxInFlight: 2}))
	claim := func(key string) error {
		_, err := c.Claim(t.Context(), claimReq(key, ""))
		return err
	}
	held := make(chan error, 2)
	for i := range 2 {
		go func() { held <- claim("held-" + strconv.Itoa(i)) }()
		<-g.entered
	}
	start := time.Now()
	err := claim("third")
	st := requireStatus(t, err, codes.Unavailable, idemregv1.ReasonOverloaded)
	require.NotContains(t, st.Message(), "pebble")
	require.Positive(t, detail[*errdetails.RetryInfo](t, err).GetRetryDelay().AsDuration())
	require.Less(t, time.Since(start), 2*time.Second, "refused at once, not after a deadline")

	close(g.gate)
	for range 2 {
		require.NoError(t, <-held)
	}
	require.NoError(t, claim("fourth"), "slots are given back")
}

func TestDeadlines(t *testing.T) {
	g := &gateStore{Store: memStore(t), entered: make(chan struct{}, 10), gate: make(chan struct{})}
	c := idemregv1.NewRegistryServiceClient(start(t, g, server.Config{RequestTimeout: 100 * time.Millisecond, MaxRequestTimeout: 300 * time.Millisecond}))

	// A store that does not answer within the budget is reported as
	// unavailable, a little before the budget or the caller's deadline
	// ends (see storeContext), so the caller gets a RetryInfo; on a loaded
	// machine the budget itself may end first. Either way the server's
	// budget ended the call, not the client.
	budgetEnded := []codes.Code{codes.Unavailable, codes.DeadlineExceeded}
	_, err := c.Claim(t.Context(), claimReq("no-deadline", ""))
	require.Contains(t, budgetEnded, statusCode(err), "%v", err)

	ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
	defer cancel()
	start := time.Now()
	_, err = c.Claim(ctx, claimReq("far-deadline", ""))
	require.Contains(t, budgetEnded, statusCode(err), "%v", err)
	require.Less(t, time.Since(start), 10*time.Second, "clamped to the server's maximum")

	ctx, cancel = context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err = c.Claim(ctx, claimReq("short-deadline", ""))
	// UNAVAILABLE 20 ms before the caller's deadline, or, on a slow
	// machine, that deadline itself: either way not the server's budget.
	require.Contains(t, []codes.Code{codes.Unavailable, codes.DeadlineExceeded}, statusCode(err), "the caller's own deadline is kept")
}

// TestLogs runs a whole flow with a JSON logger: one line per call with
// method, code, consumer, identity and duration, and nowhere a stored
// result, a fingerprint or a token.
func TestLogs(t *testing.T) {
	var buf syncBuffer
	conn := start(t, memStore(t), server.Config{Logger: jsonLogger(&buf)})
	c := idemregv1.NewRegistryServiceClient(conn)
	ctx := t.Context()
	const fingerprint, result = "fp-SECRET-7f3a", "result-SECRET-91bc"
	claimed, err := c.Claim(ctx, claimReq("log-1", fingerprint))
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("log-1", "fp-OTHER-SECRET"))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "log-1", Token: claimed.GetToken() + 1, ClaimSecret: claimed.GetClaimSecret(), Result: response(result)})
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "log-1", Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(), Result: response(result)})
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("log-1", fingerprint))
	require.NoError(t, err)
	_, err = idemregv1.NewAdminServiceClient(conn).InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "log-1", Reason: "wrong amount, ticket OPS-1"})
	require.NoError(t, err)

	calls := buf.waitLines(t, "finished call", 6)
	require.Len(t, calls, 6)
	logs := buf.String()
	for _, secret := range []string{"SECRET", strconv.FormatInt(claimed.GetToken(), 10), strconv.FormatInt(claimed.GetToken()+1, 10)} {
		require.NotContains(t, logs, secret)
	}
	// Each line is written as its call ends (gRPC's End, after the
	// response went out), so calls made one after the other may log in
	// another order: the lines are found by method and code.
	find := func(method, code string) map[string]any {
		t.Helper()
		for _, l := range calls {
			if l["grpc.method"] == method && l["grpc.code"] == code {
				return l
			}
		}
		t.Fatalf("no line for %s %s in %v", method, code, calls)
		return nil
	}
	for _, l := range calls {
		require.Equal(t, "billing.payment-worker", l["consumer"])
		require.Equal(t, "anonymous", l["identity"])
		require.NotEmpty(t, l["grpc.method"])
		require.NotEmpty(t, l["grpc.code"])
		require.Contains(t, l, "grpc.time_ms")
	}
	var mismatch map[string]any
	for _, l := range calls {
		if l["grpc.method"] == "Claim" && l["grpc.code"] == "FAILED_PRECONDITION" {
			mismatch = l
		}
	}
	require.NotNil(t, mismatch, "the mismatched Claim's line")
	require.Equal(t, "WARN", mismatch["level"])
	require.Contains(t, mismatch["grpc.error"], "different fingerprint")
	ok := find("Claim", "OK")
	require.Equal(t, "INFO", ok["level"])
	require.Equal(t, "idemreg.v1.RegistryService", ok["grpc.service"])
	require.NotContains(t, ok, "grpc.error")

	audit := buf.lines(t, "admin action")
	require.Len(t, audit, 1)
	require.Equal(t, "invalidate", audit[0]["action"])
	require.Equal(t, "wrong amount, ticket OPS-1", audit[0]["reason"])
	require.Equal(t, "log-1", audit[0]["key"])
	require.Equal(t, "ok", audit[0]["result"])
	require.Equal(t, "WARN", audit[0]["level"])
}

func TestAdminService(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx := t.Context()
		admin := idemregv1.NewAdminServiceClient(h.conn)
		c := h.client
		key := func(k string) *idemregv1.InspectRecordRequest {
			return &idemregv1.InspectRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: k}
		}
		invalidate := func(k string, token int64, reason string) (*idemregv1.InvalidateRecordResponse, error) {
			return admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: k, Token: token, Reason: reason})
		}

		_, err := admin.InspectRecord(ctx, key("adm-1"))
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
		first, err := c.Claim(ctx, claimReq("adm-1", "fp-1"))
		require.NoError(t, err)
		insp, err := admin.InspectRecord(ctx, key("adm-1"))
		require.NoError(t, err)
		require.True(t, insp.GetLive())
		require.Equal(t, first.GetToken(), insp.GetRecord().GetToken(), "an operator sees the live token")
		require.Equal(t, "fp-1", string(insp.GetRecord().GetFingerprint()))

		_, err = invalidate("adm-1", first.GetToken(), "")
		st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Equal(t, []string{"reason"}, violatedFields(st))
		_, err = invalidate("adm-1", first.GetToken()+1, "stuck worker")
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
		inv, err := invalidate("adm-1", first.GetToken(), "stuck worker")
		require.NoError(t, err)
		require.Greater(t, inv.GetRecord().GetToken(), first.GetToken())

		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "adm-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("late")})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)
		again, err := c.Claim(ctx, claimReq("adm-1", "fp-2"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
		require.Greater(t, again.GetToken(), inv.GetRecord().GetToken())
		require.EqualValues(t, 2, again.GetRecord().GetAttempt())

		h.clock.Advance(48 * time.Hour)
		insp, err = admin.InspectRecord(ctx, key("adm-1"))
		require.NoError(t, err, "expired, not swept: still visible to an operator")
		require.False(t, insp.GetLive())
		_, err = invalidate("adm-1", 0, "too late")
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)
	})
}

// TestMetrics reads the registry's instruments and otelgrpc's through a
// manual reader after a flow that hits every claim outcome.
func TestMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{MeterProvider: mp}))
	ctx := t.Context()

	first, err := c.Claim(ctx, claimReq("m-1", "fp")) // acquired
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("m-1", "fp")) // in progress
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("m-1", "other")) // mismatch
	require.Error(t, err)
	_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "m-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret()})
	require.NoError(t, err)
	second, err := c.Claim(ctx, claimReq("m-1", "fp")) // takeover
	require.NoError(t, err)
	_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "m-1", Token: first.GetToken(), ClaimSecret: first.GetClaimSecret()}) // lease lost
	require.Error(t, err)
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "m-1", Token: second.GetToken(), ClaimSecret: second.GetClaimSecret(), Result: response("r")})
	require.NoError(t, err)
	_, err = c.Claim(ctx, claimReq("m-1", "fp")) // replay
	require.NoError(t, err)
	withID := claimReq("m-2", "fp")
	withID.RequestId = "req-m-2"
	for range 2 { // acquired, then a repeat
		_, err = c.Claim(ctx, withID)
		require.NoError(t, err)
	}

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	sums := map[string]int64{}
	var names []string
	var storeDurations uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			names = append(names, m.Name)
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					key := m.Name
					for _, kv := range dp.Attributes.ToSlice() {
						key += " " + string(kv.Key) + "=" + kv.Value.Emit()
					}
					sums[key] += dp.Value
				}
			case metricdata.Histogram[float64]:
				if m.Name == server.MetricStoreDuration {
					for _, dp := range d.DataPoints {
						storeDurations += dp.Count
					}
				}
			}
		}
	}
	for _, outcome := range []string{server.ClaimInProgress, server.ClaimMismatch, server.ClaimTakeover, server.ClaimReplay, server.ClaimRepeat} {
		require.EqualValues(t, 1, sums[server.MetricClaims+" outcome="+outcome], "claims with outcome %s; got %v", outcome, sums)
	}
	require.EqualValues(t, 2, sums[server.MetricClaims+" outcome="+server.ClaimAcquired], "m-1 and m-2; got %v", sums)
	require.Contains(t, names, server.MetricStoreInFlight, "the in-flight gauge is observed")
	require.Zero(t, sums[server.MetricStoreInFlight], "nothing in flight once the calls returned")
	require.EqualValues(t, 1, sums[server.MetricCompletes])
	require.EqualValues(t, 1, sums[server.MetricReleases])
	require.EqualValues(t, 1, sums[server.MetricLeaseLost+" method=extend"])
	require.EqualValues(t, 10, storeDurations, "every store call is timed")
	require.Contains(t, names, "rpc.server.call.duration", "otelgrpc's RPC metrics share the provider; got %v", names)
}

// TestHealthListenerAndDrain: the plaintext health listener reports
// readiness (store) and liveness; on shutdown, NOT_SERVING comes first and
// calls are still served through the drain delay.
func TestHealthListenerAndDrain(t *testing.T) {
	srv, err := server.New(memStore(t), server.Config{DrainDelay: 500 * time.Millisecond, HealthInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	healthDone := make(chan error, 1)
	go func() { healthDone <- srv.ServeHealth(hlis) }()

	hconn, err := grpc.NewClient(hlis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer hconn.Close()
	hc := healthpb.NewHealthClient(hconn)
	check := func(service string) healthpb.HealthCheckResponse_ServingStatus {
		res, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			return healthpb.HealthCheckResponse_UNKNOWN
		}
		return res.GetStatus()
	}
	require.Eventually(t, func() bool { return check("") == healthpb.HealthCheckResponse_SERVING }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(server.LivenessService))
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check("idemreg.v1.RegistryService"))
	_, err = hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "idemreg.v1.Nope"})
	require.Equal(t, codes.NotFound, statusCode(err))

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	c := idemregv1.NewRegistryServiceClient(conn)
	_, err = c.Claim(t.Context(), claimReq("before", ""))
	require.NoError(t, err)

	cancel()
	require.Eventually(t, func() bool { return check("") == healthpb.HealthCheckResponse_NOT_SERVING }, 5*time.Second, 5*time.Millisecond)
	_, err = c.Claim(t.Context(), claimReq("during-drain-delay", ""))
	require.NoError(t, err, "calls are served while load balancers catch up")
	require.NoError(t, <-done)
	require.NoError(t, <-healthDone, "the health listener stops with the server")
}

func statusOf(err error) *status.Status { return status.Convert(err) }
