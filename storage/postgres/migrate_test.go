package postgres_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestConcurrentMigrationsTakeTurns: runs of migrate started together on
// an empty database all succeed, and each migration is recorded once.
func TestConcurrentMigrationsTakeTurns(t *testing.T) {
	for round := range 3 {
		db := pgtest.NewEmptyDatabase(t)
		const runs = 6
		errs := make([]error, runs)
		var wg sync.WaitGroup
		for i := range runs {
			wg.Go(func() { errs[i] = postgres.Migrate(t.Context(), db) })
		}
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "round %d, run %d", round, i)
		}
		conn, err := pgx.Connect(t.Context(), db)
		require.NoError(t, err)
		var n, distinct, locks int
		require.NoError(t, conn.QueryRow(t.Context(), `SELECT count(*), count(DISTINCT name) FROM idemreg_schema_migrations`).Scan(&n, &distinct))
		require.Equal(t, distinct, n)
		require.Equal(t, postgres.MigrationCount(), n)
		require.NoError(t, conn.QueryRow(t.Context(), `SELECT count(*) FROM idemreg_migration_lock`).Scan(&locks))
		require.Zero(t, locks, "every run released the lock")
		require.NoError(t, conn.Close(t.Context()))
	}
}

// TestMigrateWaitsForTheLock: a run finding the lock held waits for it,
// says who holds it when its context ends first, and takes over a lock
// whose holder died (expired).
func TestMigrateWaitsForTheLock(t *testing.T) {
	db := pgtest.NewEmptyDatabase(t)
	require.NoError(t, postgres.Migrate(t.Context(), db))
	conn, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(t.Context(), `INSERT INTO idemreg_migration_lock (id, holder, expires_at) VALUES (1, 'deploy-job-7', now() + interval '1 hour')`)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err = postgres.Migrate(ctx, db)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "another migrate (deploy-job-7) holds the migration lock until ")

	done := make(chan error, 1)
	go func() { done <- postgres.Migrate(t.Context(), db) }()
	_, err = conn.Exec(t.Context(), `DELETE FROM idemreg_migration_lock`)
	require.NoError(t, err)
	require.NoError(t, <-done, "the waiting run goes on once the lock is free")

	// A holder that died: its lock expired.
	_, err = conn.Exec(t.Context(), `INSERT INTO idemreg_migration_lock (id, holder, expires_at) VALUES (1, 'dead', now() - interval '1 second')`)
	require.NoError(t, err)
	require.NoError(t, postgres.Migrate(t.Context(), db))
}

// TestRowLevelTTLOnPostgreSQL: Migrate refuses the row-level TTL variant on
// PostgreSQL and leaves the base schema as it is; RowLevelTTL reports the
// variant from the bookkeeping, which is what serve and sweep consult.
func TestRowLevelTTLOnPostgreSQL(t *testing.T) {
	db := pgtest.NewEmptyDatabase(t)
	err := postgres.Migrate(t.Context(), db, postgres.WithRowLevelTTL())
	require.ErrorContains(t, err, "row-level TTL needs CockroachDB")
	require.NoError(t, postgres.Migrate(t.Context(), db))

	conn, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var variants []string
	rows, err := conn.Query(t.Context(), `SELECT DISTINCT variant FROM idemreg_schema_migrations`)
	require.NoError(t, err)
	variants, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"base"}, variants)
	var indexed bool
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE indexname = 'idemreg_records_expires_at')`).Scan(&indexed))
	require.True(t, indexed, "PostgreSQL keeps the expires_at index")

	s := openStore(t, db)
	ttl, err := s.RowLevelTTL(t.Context())
	require.NoError(t, err)
	require.False(t, ttl)
	_, err = conn.Exec(t.Context(), `INSERT INTO idemreg_schema_migrations (name, variant) VALUES ('ttl_0001_row_level_ttl.sql', $1)`, postgres.VariantRowLevelTTL)
	require.NoError(t, err)
	ttl, err = s.RowLevelTTL(t.Context())
	require.NoError(t, err)
	require.True(t, ttl)

	never := openStore(t, pgtest.NewEmptyDatabase(t))
	ttl, err = never.RowLevelTTL(t.Context())
	require.NoError(t, err)
	require.False(t, ttl, "a database never migrated has no TTL")
}

// TestMigrateReportAndStatus: MigrateReport returns what a run applied
// (nothing on an up-to-date schema), and MigrationStatus lists the applied
// and pending migrations without changing anything.
func TestMigrateReportAndStatus(t *testing.T) {
	db := pgtest.NewEmptyDatabase(t)
	applied, pending, err := postgres.MigrationStatus(t.Context(), db)
	require.NoError(t, err)
	require.Empty(t, applied, "a database never migrated")
	require.Len(t, pending, postgres.MigrationCount())
	require.Zero(t, postgres.SchemaVersion(applied))
	_, _, err = postgres.MigrationStatus(t.Context(), db)
	require.NoError(t, err, "status created nothing it then trips on")

	done, err := postgres.MigrateReport(t.Context(), db)
	require.NoError(t, err)
	require.Equal(t, pending, withoutTimes(done), "the run applied what status said was pending, in order")
	again, err := postgres.MigrateReport(t.Context(), db)
	require.NoError(t, err)
	require.Empty(t, again)

	applied, pending, err = postgres.MigrationStatus(t.Context(), db)
	require.NoError(t, err)
	require.Empty(t, pending)
	require.Equal(t, withoutTimes(done), withoutTimes(applied))
	for _, m := range applied {
		require.False(t, m.AppliedAt.IsZero(), m.Name)
	}
	require.Equal(t, postgres.MigrationCount(), postgres.SchemaVersion(applied), "the files are numbered 1 to n")
	require.Equal(t, 7, postgres.Migration{Name: "0007_history_and_parked_index.sql"}.Version())
	require.Zero(t, postgres.Migration{Name: "ttl_0001_row_level_ttl.sql"}.Version())
}

func withoutTimes(ms []postgres.Migration) []postgres.Migration {
	out := make([]postgres.Migration, len(ms))
	for i, m := range ms {
		m.AppliedAt = time.Time{}
		out[i] = m
	}
	return out
}

func TestMigrateTwiceIsNoOp(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t) // migrated once
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())

	type row struct {
		Name      string
		Variant   string
		AppliedAt time.Time
	}
	applied := func() []row {
		rows, err := conn.Query(t.Context(), `SELECT name, variant, applied_at FROM idemreg_schema_migrations ORDER BY name`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
		require.NoError(t, err)
		return out
	}
	first := applied()
	require.Len(t, first, 9)
	require.Equal(t, "0001_records.sql", first[0].Name)
	require.Equal(t, "0002_expires_at_index.sql", first[1].Name)
	require.Equal(t, "0003_request_id.sql", first[2].Name)
	require.Equal(t, "0004_lease_us.sql", first[3].Name)
	require.Equal(t, "0005_secrets.sql", first[4].Name)
	require.Equal(t, "0006_parking.sql", first[5].Name)
	require.Equal(t, "0007_history_and_parked_index.sql", first[6].Name)
	require.Equal(t, "0008_claim_keys.sql", first[7].Name)

	require.NoError(t, postgres.Migrate(t.Context(), databaseURL))
	require.Equal(t, first, applied(), "a second Migrate applies nothing")

	// A crash between a migration and its bookkeeping runs it again.
	_, err = conn.Exec(t.Context(), `DELETE FROM idemreg_schema_migrations`)
	require.NoError(t, err)
	require.NoError(t, postgres.Migrate(t.Context(), databaseURL), "migrations are safe to repeat")
	require.Len(t, applied(), 9)
}
