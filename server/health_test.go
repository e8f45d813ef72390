package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestReadinessFollowsRealQueries breaks a real PostgreSQL database in the
// ways a ping does not see, and back: readiness must follow the queries.
//   - Writes refused (a trigger raising read_only_sql_transaction, as a
//     read-only database or replica does): reads, and so the ping and the
//     probe, still answer; the failing Claims turn the server
//     NOT_SERVING, and Claims that succeed again turn it back.
//   - The disk full (a trigger raising disk_full, 53100): Claims are
//     CAPACITY_EXHAUSTED, and the server stays SERVING, since every
//     replica shares the database and reads still answer.
//   - The table gone (renamed, as a bad migration leaves it): the probe
//     read fails with no traffic at all.
func TestReadinessFollowsRealQueries(t *testing.T) {
	dbURL := pgtest.NewDatabase(t)
	store, err := postgres.Open(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	admin, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	exec := func(sql string) {
		t.Helper()
		_, err := admin.Exec(t.Context(), sql)
		require.NoError(t, err)
	}

	conn := start(t, store, server.Config{
		HealthInterval: 20 * time.Millisecond,
		Readiness:      server.Readiness{Window: 3, MinCalls: 5},
	})
	hc := healthpb.NewHealthClient(conn)
	rc := idemregv1.NewRegistryServiceClient(conn)
	status := func() healthpb.HealthCheckResponse_ServingStatus {
		res, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		return res.GetStatus()
	}
	n := 0
	// claims sends a few Claims of new keys and reports how many failed
	// with STORE_UNAVAILABLE (the others must succeed).
	claims := func() (failed int) {
		for range 10 {
			n++
			_, err := rc.Claim(t.Context(), claimReq(fmt.Sprintf("k-%d", n), "fp"))
			if err != nil {
				requireStatus(t, err, codes.Unavailable, idemregv1.ReasonStoreUnavailable)
				failed++
			}
		}
		return failed
	}
	const waitFor, tick = 20 * time.Second, 10 * time.Millisecond
	require.Eventually(t, func() bool { return status() == healthpb.HealthCheckResponse_SERVING }, waitFor, tick)

	t.Run("writes refused", func(t *testing.T) {
		exec(`CREATE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction'; END $$`)
		exec(`CREATE TRIGGER refuse_writes BEFORE INSERT OR UPDATE ON idemreg_records FOR EACH ROW EXECUTE FUNCTION refuse_writes()`)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, status(), "a ping and a read still answer")
		require.Eventually(t, func() bool { return claims() == 10 && status() == healthpb.HealthCheckResponse_NOT_SERVING }, waitFor, tick,
			"every Claim fails: readiness must say so")
		_, err := rc.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k-1"})
		requireStatus(t, err, codes.NotFound, idemregv1.ReasonNotFound)

		exec(`DROP TRIGGER refuse_writes ON idemreg_records`)
		exec(`DROP FUNCTION refuse_writes()`)
		require.Eventually(t, func() bool { return claims() == 0 && status() == healthpb.HealthCheckResponse_SERVING }, waitFor, tick,
			"Claims succeed again: so does readiness")
	})

	t.Run("disk full", func(t *testing.T) {
		exec(`CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = 'disk_full'; END $$`)
		exec(`CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE ON idemreg_records FOR EACH ROW EXECUTE FUNCTION disk_full()`)
		// Many windows' worth of refused Claims (3 intervals of 20 ms
		// each, 5 calls make a rate), each round checked.
		for range 20 {
			for range 10 {
				n++
				_, err := rc.Claim(t.Context(), claimReq(fmt.Sprintf("k-%d", n), "fp"))
				requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonCapacityExhausted)
			}
			time.Sleep(20 * time.Millisecond)
			require.Equal(t, healthpb.HealthCheckResponse_SERVING, status(), "a full disk is not a reason to send callers elsewhere")
		}
		exec(`DROP TRIGGER disk_full ON idemreg_records`)
		require.Zero(t, claims())
	})

	t.Run("table gone", func(t *testing.T) {
		exec(`ALTER TABLE idemreg_records RENAME TO idemreg_records_gone`)
		require.Eventually(t, func() bool { return status() == healthpb.HealthCheckResponse_NOT_SERVING }, waitFor, tick,
			"the probe's read fails though the ping answers")
		exec(`ALTER TABLE idemreg_records_gone RENAME TO idemreg_records`)
		require.Eventually(t, func() bool { return status() == healthpb.HealthCheckResponse_SERVING }, waitFor, tick)
		require.Zero(t, claims())
	})
}
