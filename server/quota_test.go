package server_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// quotaFile is a config file holding doc.
func quotaFile(t *testing.T, doc string) *configfile.Source {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(path, []byte(doc), 0o600))
	src, err := configfile.Open(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	return src
}

const quotaDoc = `
consumers:
  - {name: quota.a, max_records: 3}
  - {name: quota.bytes, max_bytes: 100}
  - {prefix: quota.p., max_records: 1}
`

// quotaConfig counts usage every hour: in a test, only when a consumer is
// first seen (the quota mechanics, refreshes included, are
// server/internal/quota's tests; these are the answers a caller gets).
func quotaConfig(t *testing.T) server.Config {
	return server.Config{File: quotaFile(t, quotaDoc), QuotaRefresh: time.Hour}
}

// quotaServer is a served registry whose metrics the test reads.
type quotaServer struct {
	idemregv1.RegistryServiceClient
	srv    *server.Server
	reader *sdkmetric.ManualReader
}

// serveQuota serves store with cfg, its metrics read by hand.
func serveQuota(t *testing.T, store storage.Store, cfg server.Config) *quotaServer {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	addr, srv := servertest.Serve(t, store, cfg)
	return &quotaServer{RegistryServiceClient: idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr)), srv: srv, reader: reader}
}

// counts are the server's counts of the quotas' usage so far
// (idemreg.quota.refreshes), done and failed.
func (q *quotaServer) counts(t *testing.T) (done, failed int64) {
	sums := collectSums(t, q.reader)
	return sums[server.MetricQuotaRefreshes+" result=ok"], sums[server.MetricQuotaRefreshes+" result=failed"]
}

// waitCounted waits for the server's count of the consumers it saw first
// since it had done done counts: after it, until another consumer is seen
// first, the usage changes only by the server's own Claims, which a test
// can then predict.
func (q *quotaServer) waitCounted(t *testing.T, done int64) {
	t.Helper()
	require.Eventually(t, func() bool { n, _ := q.counts(t); return n > done }, time.Minute, time.Millisecond)
}

func quotaClaim(consumer, key string) *idemregv1.ClaimRequest {
	return &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Fingerprint: []byte("fp"), Lease: durationpb.New(10 * time.Second), Holder: "h"}
}

func requireAcquired(t *testing.T, c idemregv1.RegistryServiceClient, consumer, key string) *idemregv1.ClaimResponse {
	t.Helper()
	res, err := c.Claim(t.Context(), quotaClaim(consumer, key))
	require.NoError(t, err, "%s/%s", consumer, key)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome(), "%s/%s", consumer, key)
	return res
}

// requireQuotaExceeded checks a QUOTA_EXCEEDED answer and returns its
// QuotaFailure violation.
func requireQuotaExceeded(t *testing.T, err error, consumer string) *errdetails.QuotaFailure_Violation {
	t.Helper()
	requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonQuotaExceeded)
	var qf *errdetails.QuotaFailure
	for _, d := range status.Convert(err).Details() {
		if v, ok := d.(*errdetails.QuotaFailure); ok {
			qf = v
		}
	}
	require.NotNil(t, qf, "status carries no QuotaFailure")
	require.Len(t, qf.GetViolations(), 1)
	require.Equal(t, "consumer:"+consumer, qf.GetViolations()[0].GetSubject())
	return qf.GetViolations()[0]
}

// TestQuotaRecords: a consumer with max_records 3 gets 3 new keys; once
// counted, a 4th new key is refused with QUOTA_EXCEEDED, alone or in a
// batch, while Claims of its keys (replay, in progress, takeover) and
// Complete, Release and Extend keep working, other consumers are not
// affected, and a prefix's quota is each consumer's own. (That expired
// records leave the count at the next refresh is quota's
// TestExpiredRecordsLeaveAtRefresh.)
func TestQuotaRecords(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			ctx := t.Context()
			c := serveQuota(t, b.open(t, &storagetest.Clock{}), quotaConfig(t))

			held := []*idemregv1.ClaimResponse{requireAcquired(t, c, "quota.a", "k1")}
			c.waitCounted(t, 0)
			for _, k := range []string{"k2", "k3"} {
				held = append(held, requireAcquired(t, c, "quota.a", k))
			}

			_, err := c.Claim(ctx, quotaClaim("quota.a", "k4"))
			v := requireQuotaExceeded(t, err, "quota.a")
			require.Equal(t, `at most 3 live records (max_records of consumer "quota.a"); 3 known`, v.GetDescription())
			require.Contains(t, status.Convert(err).Message(), "Claims of its live keys still work")

			// Its live keys keep working.
			busy, err := c.Claim(ctx, quotaClaim("quota.a", "k1"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, busy.GetOutcome())
			_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: "quota.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k1",
				Token: held[0].GetToken(), ClaimSecret: held[0].GetClaimSecret()})
			require.NoError(t, err)
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "quota.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k2",
				Token: held[1].GetToken(), ClaimSecret: held[1].GetClaimSecret(), Result: response("done")})
			require.NoError(t, err)
			replay, err := c.Claim(ctx, quotaClaim("quota.a", "k2"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
			_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: "quota.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k3",
				Token: held[2].GetToken(), ClaimSecret: held[2].GetClaimSecret()})
			require.NoError(t, err)
			takeover := requireAcquired(t, c, "quota.a", "k3")
			require.EqualValues(t, 2, takeover.GetRecord().GetAttempt())

			// Other consumers are not affected; a prefix's quota is each
			// consumer's own.
			for _, k := range []string{"x1", "x2", "x3", "x4"} {
				requireAcquired(t, c, "quota.other", k)
			}
			requireAcquired(t, c, "quota.p.x", "k1")
			requireAcquired(t, c, "quota.p.y", "k1")
			_, err = c.Claim(ctx, quotaClaim("quota.p.x", "k2"))
			requireQuotaExceeded(t, err, "quota.p.x")

			// A batch answers item by item.
			batch, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
				quotaClaim("quota.a", "k5"), quotaClaim("quota.a", "k2"), quotaClaim("quota.other", "x5"), quotaClaim("quota.p.y", "k2"),
			}})
			require.NoError(t, err)
			_, err = claimResult(batch.GetResults()[0])
			requireQuotaExceeded(t, err, "quota.a")
			res, err := claimResult(batch.GetResults()[1])
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome())
			res, err = claimResult(batch.GetResults()[2])
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
			_, err = claimResult(batch.GetResults()[3])
			requireQuotaExceeded(t, err, "quota.p.y")
		})
	}
}

// TestQuotaBytes: max_bytes counts what storage.RecordBytes names. A
// Complete may store a result past the quota (the bytes are checked at
// Claim time only); the next new key is then refused, replays still work.
// (That what this replica adds agrees with the store's count is quota's
// TestBytes.)
func TestQuotaBytes(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			ctx := t.Context()
			c := serveQuota(t, b.open(t, &storagetest.Clock{}), quotaConfig(t))

			first := requireAcquired(t, c, "quota.bytes", "b1")
			c.waitCounted(t, 0)
			requireAcquired(t, c, "quota.bytes", "b2") // 34 bytes of 100
			result := response(strings.Repeat("r", 80))
			_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: "quota.bytes", Kind: idemregv1.Kind_KIND_OPERATION, Key: "b1",
				Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Result: result})
			require.NoError(t, err, "a Complete is never refused for the quota")

			_, err = c.Claim(ctx, quotaClaim("quota.bytes", "b3"))
			v := requireQuotaExceeded(t, err, "quota.bytes")
			require.Contains(t, v.GetDescription(), `at most 100 bytes of live records (max_bytes of consumer "quota.bytes")`)
			replay, err := c.Claim(ctx, quotaClaim("quota.bytes", "b1"))
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
		})
	}
}

// TestQuotaAcrossReplicas: two replicas of one database, which find each
// other through the membership, share a quota: each admits half of what
// it had left at its last count, and says so in its refusal. (How the
// counts of several replicas meet is quota's TestCountAcrossReplicas.)
func TestQuotaAcrossReplicas(t *testing.T) {
	ctx := t.Context()
	db := pgtest.NewDatabase(t)
	replica := func() *quotaServer {
		s, err := postgres.Open(ctx, db)
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return serveQuota(t, s, quotaConfig(t))
	}
	a, b := replica(), replica()
	seeReplicas(t, 2, a.srv, b.srv)
	// Each of the two live replicas admits half of what the quota (3) had
	// left at its last count (one record, its own): A two new keys, not
	// three.
	requireAcquired(t, a, "quota.a", "k1")
	a.waitCounted(t, 0)
	requireAcquired(t, a, "quota.a", "k2")
	_, err := a.Claim(ctx, quotaClaim("quota.a", "k3"))
	requireQuotaExceeded(t, err, "quota.a")
	require.Contains(t, status.Convert(err).Message(), "its share (1/2")
	requireAcquired(t, b, "quota.a", "k3") // b has not counted yet
}

// seeReplicas waits until each of srvs counts n live replicas, which is
// what their limits are shared by.
func seeReplicas(t *testing.T, n int, srvs ...*server.Server) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, s := range srvs {
			if len(s.Members()) != n {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond)
}

// TestQuotaRefreshLoop: the server refreshes on its own every
// QuotaRefresh (idemreg.quota.refreshes counts them), and its loop stops
// with Serve: no goroutine is left.
func TestQuotaRefreshLoop(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	srv, err := server.New(memStore(t), server.Config{File: quotaFile(t, quotaDoc), QuotaRefresh: time.Millisecond,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	c := idemregv1.NewRegistryServiceClient(servertest.Dial(t, lis.Addr().String()))
	requireAcquired(t, c, "quota.a", "k1")
	// Wait on the refresh counter, not on a duration.
	require.Eventually(t, func() bool {
		return collectSums(t, reader)[server.MetricQuotaRefreshes+" result=ok"] >= 3
	}, time.Minute, time.Millisecond)

	cancel()
	require.NoError(t, <-done)
	var stacks strings.Builder
	require.NoError(t, pprof.Lookup("goroutine").WriteTo(&stacks, 1))
	require.NotContains(t, stacks.String(), "quota.(*Quotas).Run", "the refresh loop ended before Serve returned")
}

// TestQuotaCountedWhenFirstSeen: a consumer Claiming for the first time on
// a replica is counted at once, not at the next QuotaRefresh (here an
// hour away); a consumer without a quota is not.
func TestQuotaCountedWhenFirstSeen(t *testing.T) {
	c := serveQuota(t, memStore(t), quotaConfig(t))
	requireAcquired(t, c, "quota.other", "k1")
	requireAcquired(t, c, "quota.a", "k1")
	c.waitCounted(t, 0)
	done, failed := c.counts(t)
	require.EqualValues(t, 1, done, "one count, of quota.a")
	require.Zero(t, failed)
}

// TestQuotaCost: Claims of consumers under their quota, or without one,
// make no store call but their Claim; only a consumer at its quota pays a
// Lookup per Claim, and a refused one makes no Claim. The replica counts
// its own new keys between refreshes, so it needs none to refuse here.
func TestQuotaCost(t *testing.T) {
	c := serveQuota(t, memStore(t), quotaConfig(t))
	ops := func() map[string]uint64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, c.reader.Collect(t.Context(), &rm))
		out := map[string]uint64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if h, ok := m.Data.(metricdata.Histogram[float64]); ok && m.Name == server.MetricStoreDuration {
					for _, dp := range h.DataPoints {
						op, _ := dp.Attributes.Value("op")
						out[op.AsString()] += dp.Count
					}
				}
			}
		}
		return out
	}
	requireAcquired(t, c, "quota.a", "k1")
	c.waitCounted(t, 0) // the count of quota.a, seen first, is not a Claim's
	requireAcquired(t, c, "quota.other", "k1")
	for _, k := range []string{"k2", "k3"} {
		requireAcquired(t, c, "quota.a", k)
		requireAcquired(t, c, "quota.other", k)
	}
	require.Equal(t, map[string]uint64{"claim": 6}, ops(), "under its quota or without one, a Claim is one store call")

	_, err := c.Claim(t.Context(), quotaClaim("quota.a", "k4"))
	requireQuotaExceeded(t, err, "quota.a")
	require.Equal(t, map[string]uint64{"claim": 6, "lookup": 1}, ops(), "refused after one Lookup, without a Claim")
	_, err = c.Claim(t.Context(), quotaClaim("quota.a", "k1"))
	require.NoError(t, err)
	require.Equal(t, map[string]uint64{"claim": 7, "lookup": 2}, ops())
}

// TestQuotaReload: a reload that removes a consumer's quota lifts it at
// once; one that adds a quota applies from the consumer's next Claim.
// (That the next refresh stops following the first, and counts the
// second, is quota's TestPolicyChange.)
func TestQuotaReload(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	write := func(doc string) {
		tmp := path + ".next"
		require.NoError(t, os.WriteFile(tmp, []byte(doc), 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}
	write("consumers:\n  - {name: quota.r, max_records: 1}\n")
	src, err := configfile.Open(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	c := serveQuota(t, memStore(t), server.Config{File: src, QuotaRefresh: time.Hour})

	requireAcquired(t, c, "quota.r", "k1")
	c.waitCounted(t, 0)
	requireAcquired(t, c, "quota.s", "k1")
	_, err = c.Claim(ctx, quotaClaim("quota.r", "k2"))
	requireQuotaExceeded(t, err, "quota.r")

	write("consumers:\n  - {name: quota.s, max_records: 1}\n")
	_, err = src.Reload()
	require.NoError(t, err)
	requireAcquired(t, c, "quota.r", "k2")
	done, _ := c.counts(t)
	requireAcquired(t, c, "quota.s", "k2") // now seen with a quota: counted as empty until its first count
	c.waitCounted(t, done)
	_, err = c.Claim(ctx, quotaClaim("quota.s", "k3"))
	v := requireQuotaExceeded(t, err, "quota.s")
	require.Contains(t, v.GetDescription(), "2 known")
}
