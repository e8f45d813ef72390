package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// parkingPolicy gives billing.payment-worker (the consumer of claimReq)
// max_attempts 2 and every other consumer none.
func parkingPolicy(t *testing.T) *policy.Set {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	require.NoError(t, os.WriteFile(path, []byte("consumers:\n  - name: billing.payment-worker\n    max_attempts: 2\n"), 0o600))
	set, err := policy.Load(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	return set
}

func parkReq(key string, token int64, secret []byte, reason string) *idemregv1.ParkRequest {
	return &idemregv1.ParkRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Token: token, ClaimSecret: secret, Reason: reason}
}

func requireParkedAnswer(t *testing.T, res *idemregv1.ClaimResponse, reason string) {
	t.Helper()
	require.Equal(t, idemregv1.Outcome_OUTCOME_PARKED, res.GetOutcome())
	require.Zero(t, res.GetToken(), "no token")
	require.Empty(t, res.GetClaimSecret(), "no claim secret")
	require.Equal(t, idemregv1.State_STATE_PARKED, res.GetRecord().GetState())
	require.Zero(t, res.GetRecord().GetToken(), "the parked holder's token is withheld")
	require.Equal(t, reason, res.GetRecord().GetParkReason())
}

func TestParking(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			clock := &storagetest.Clock{}
			conn := start(t, b.open(t, clock), server.Config{Policy: parkingPolicy(t)})
			c := idemregv1.NewRegistryServiceClient(conn)
			ctx := t.Context()

			// max_attempts 2: attempts 1 and 2 acquire, the next Claim parks.
			first, err := c.Claim(ctx, claimReq("pay-1", "fp"))
			require.NoError(t, err)
			require.EqualValues(t, 1, first.GetRecord().GetAttempt())
			clock.Advance(11 * time.Second)
			second, err := c.Claim(ctx, claimReq("pay-1", "fp"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, second.GetOutcome())
			require.EqualValues(t, 2, second.GetRecord().GetAttempt())
			clock.Advance(11 * time.Second)
			parked, err := c.Claim(ctx, claimReq("pay-1", "fp"))
			require.NoError(t, err)
			requireParkedAnswer(t, parked, storage.ParkReasonMaxAttempts)
			require.EqualValues(t, 2, parked.GetRecord().GetAttempt())
			again, err := c.Claim(ctx, claimReq("pay-1", ""))
			require.NoError(t, err)
			requireParkedAnswer(t, again, storage.ParkReasonMaxAttempts)
			_, err = c.Claim(ctx, claimReq("pay-1", "other"))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonFingerprintMismatch)

			// The last holder may not complete, release or extend it.
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1",
				Token: second.GetToken(), ClaimSecret: second.GetClaimSecret(), Result: response("late")})
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonParked)
			_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1",
				Token: second.GetToken(), ClaimSecret: second.GetClaimSecret()})
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonParked)
			_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-1",
				Token: second.GetToken(), ClaimSecret: second.GetClaimSecret()})
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonParked)

			// BatchClaim items answer it too.
			batch, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{claimReq("pay-1", "fp"), claimReq("pay-2", "fp")}})
			require.NoError(t, err)
			requireParkedAnswer(t, batch.GetResults()[0].GetResponse(), storage.ParkReasonMaxAttempts)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, batch.GetResults()[1].GetResponse().GetOutcome())

			// Park by the holder: fenced by the token and its claim secret.
			own := batch.GetResults()[1].GetResponse()
			_, err = c.Park(ctx, parkReq("pay-2", own.GetToken(), forged, "sent, no answer"))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
			_, err = c.Park(ctx, parkReq("pay-2", own.GetToken()-1, own.GetClaimSecret(), "sent, no answer"))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
			res, err := c.Park(ctx, parkReq("pay-2", own.GetToken(), own.GetClaimSecret(), "sent, no answer"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.State_STATE_PARKED, res.GetRecord().GetState())
			require.Equal(t, "sent, no answer", res.GetRecord().GetParkReason())
			require.Equal(t, own.GetToken(), res.GetRecord().GetToken(), "the holder sees its token")
			res, err = c.Park(ctx, parkReq("pay-2", own.GetToken(), own.GetClaimSecret(), "again"))
			require.NoError(t, err, "a repeat succeeds")
			require.Equal(t, "sent, no answer", res.GetRecord().GetParkReason(), "the first reason stays")
			after, err := c.Claim(ctx, claimReq("pay-2", "fp"))
			require.NoError(t, err)
			requireParkedAnswer(t, after, "sent, no answer")
			looked, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-2"})
			require.NoError(t, err)
			require.Equal(t, idemregv1.State_STATE_PARKED, looked.GetRecord().GetState())

			// A completed record cannot be parked.
			done, err := c.Claim(ctx, claimReq("pay-3", "fp"))
			require.NoError(t, err)
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "pay-3",
				Token: done.GetToken(), ClaimSecret: done.GetClaimSecret(), Result: response("r")})
			require.NoError(t, err)
			_, err = c.Park(ctx, parkReq("pay-3", done.GetToken(), done.GetClaimSecret(), "too late"))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonAlreadyCompleted)
			_, err = c.Park(ctx, parkReq("pay-4", done.GetToken(), done.GetClaimSecret(), "no such key"))
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid) // the secret is not for pay-4

			// Another consumer has no max_attempts: takeovers go on.
			other := claimReq("pay-1", "fp")
			other.Consumer = "orders.payment-worker"
			for attempt := int64(1); attempt <= 3; attempt++ {
				res, err := c.Claim(ctx, other)
				require.NoError(t, err)
				require.Equal(t, attempt, res.GetRecord().GetAttempt())
				clock.Advance(11 * time.Second)
			}
		})
	}
}

func TestParkValidation(t *testing.T) {
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{}))
	ctx := t.Context()
	for _, tc := range []struct {
		name   string
		req    *idemregv1.ParkRequest
		fields []string
	}{
		{"no reason", parkReq("k", 1, forged, ""), []string{"reason"}},
		{"reason too long", parkReq("k", 1, forged, strings.Repeat("x", server.MaxParkReasonBytes+1)), []string{"reason"}},
		{"reason with a newline", parkReq("k", 1, forged, "a\nb"), []string{"reason"}},
		{"reason not UTF-8", parkReq("k", 1, forged, "\xff"), []string{"reason"}},
		{"no token, no secret", parkReq("k", 0, nil, "r"), []string{"token", "claim_secret"}},
		{"no key", parkReq("", 1, forged, "r"), []string{"key"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Park(ctx, tc.req)
			st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, tc.fields, violatedFields(st))
		})
	}
	_, err := c.Park(ctx, parkReq("k", 1, forged, strings.Repeat("é", server.MaxParkReasonBytes/2)))
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid) // valid: 512 bytes
}

func TestParkMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{MeterProvider: mp}))
	ctx := t.Context()
	first, err := c.Claim(ctx, claimReq("m-1", "fp"))
	require.NoError(t, err)
	_, err = c.Park(ctx, parkReq("m-1", first.GetToken(), first.GetClaimSecret(), "unknown"))
	require.NoError(t, err)
	for range 2 {
		_, err = c.Claim(ctx, claimReq("m-1", "fp"))
		require.NoError(t, err)
	}
	_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "m-1",
		Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: response("late")})
	requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonParked)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	sums := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range d.DataPoints {
					key := m.Name
					for _, kv := range dp.Attributes.ToSlice() {
						key += " " + string(kv.Key) + "=" + kv.Value.Emit()
					}
					sums[key] += dp.Value
				}
			}
		}
	}
	require.EqualValues(t, 2, sums[server.MetricClaims+" outcome="+server.ClaimParked], "got %v", sums)
	require.EqualValues(t, 1, sums[server.MetricParks], "got %v", sums)
	require.Zero(t, sums[server.MetricStoreErrors+" error.type=internal op=complete"], "a refusal as PARKED is an answer, not a store error; got %v", sums)
}

// TestParkEndsWaits: a Claim waiting for a key in progress answers
// OUTCOME_PARKED when the holder parks it, and a waiting Claim of a parked
// key answers at once: nobody holds it, so there is nothing to wait for.
func TestParkEndsWaits(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	forEachWaitBackend(t, server.Config{MeterProvider: mp}, func(t *testing.T, h waitHarness) {
		ctx := t.Context()
		held, err := h.c.Claim(ctx, claimReq("w-1", "fp"))
		require.NoError(t, err)
		waiter := claimAsync(ctx, h.newClient(t), waiting("w-1", 25*time.Second))
		h.waitersReach(t, 1)
		_, err = h.c.Park(ctx, parkReq("w-1", held.GetToken(), held.GetClaimSecret(), "unknown"))
		require.NoError(t, err)
		select {
		case a := <-waiter:
			require.NoError(t, a.err)
			requireParkedAnswer(t, a.res, "unknown")
		case <-time.After(20 * time.Second):
			t.Fatal("the waiter did not answer when the key was parked")
		}
		res, err := h.c.Claim(ctx, waiting("w-1", 25*time.Second))
		require.NoError(t, err)
		requireParkedAnswer(t, res, "unknown")
	})
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	var parked, other int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == server.MetricWaits {
				for _, dp := range d.DataPoints {
					if v, _ := dp.Attributes.Value("ended"); v.AsString() == server.WaitParked {
						parked += dp.Value
					} else {
						other += dp.Value
					}
				}
			}
		}
	}
	require.EqualValues(t, len(backends), parked, "one wait per backend ended parked")
	require.Zero(t, other, "no wait ended otherwise")
}
