package postgres

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMigrationOverlay(t *testing.T) {
	names := func(ms []migration) (out []string) {
		for _, m := range ms {
			out = append(out, m.variant+"/"+m.name)
		}
		return out
	}
	base, err := migrations(false, false)
	require.NoError(t, err)
	require.Equal(t, []string{"base/0001_records.sql", "base/0002_expires_at_index.sql", "base/0003_request_id.sql", "base/0004_lease_us.sql", "base/0005_secrets.sql", "base/0006_parking.sql", "base/0007_history_and_parked_index.sql", "base/0008_claim_keys.sql", "base/0009_members_and_waiters.sql"}, names(base))

	baseTTL, err := migrations(false, true)
	require.NoError(t, err)
	require.Equal(t, names(base), names(baseTTL), "no TTL files on PostgreSQL (Migrate refuses the option there)")

	crdb, err := migrations(true, false)
	require.NoError(t, err)
	require.Equal(t, []string{"cockroach/0001_records.sql", "cockroach/0002_expires_at_index.sql", "base/0003_request_id.sql", "base/0004_lease_us.sql", "base/0005_secrets.sql", "cockroach/0006_parking.sql", "base/0007_history_and_parked_index.sql", "base/0008_claim_keys.sql", "base/0009_members_and_waiters.sql"}, names(crdb),
		"the overlay replaces the base file of the same name")
	require.Contains(t, crdb[0].sql, "PRIMARY KEY (consumer, kind, key) USING HASH")
	require.Contains(t, crdb[1].sql, "USING HASH")

	ttl, err := migrations(true, true)
	require.NoError(t, err)
	require.Equal(t, append(names(crdb), "cockroach-ttl/ttl_0001_row_level_ttl.sql", "cockroach-ttl/ttl_0002_drop_expires_at_index.sql"), names(ttl),
		"the TTL files come after every other, and replace none")
	require.Contains(t, ttl[9].sql, "ttl_expiration_expression = 'expires_at'")
	require.NotContains(t, ttl[9].sql, "DROP INDEX", "one schema change per file (its own transaction)")
	require.Contains(t, ttl[10].sql, "DROP INDEX IF EXISTS idemreg_records@idemreg_records_expires_at")
	for _, m := range ttl {
		require.Equal(t, m.variant == VariantRowLevelTTL, strings.HasPrefix(m.name, "ttl_"), "%s: TTL files are named ttl_", m.name)
	}

	// The hash-sharded table is the base table with only its key changed:
	// a column added to one and not the other would make the two schemas
	// drift.
	strip := func(sql string) []string {
		var out []string
		for _, line := range strings.Split(sql, "\n") {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "--") {
				continue
			}
			out = append(out, strings.TrimSpace(strings.SplitN(line, "--", 2)[0]))
		}
		return out
	}
	hashed := strip(crdb[0].sql)
	for i, line := range hashed {
		hashed[i] = strings.Replace(line, "PRIMARY KEY (consumer, kind, key) USING HASH", "PRIMARY KEY (consumer, kind, key)", 1)
	}
	require.Equal(t, strip(base[0].sql), hashed,
		"cockroach/0001_records.sql is ../0001_records.sql with USING HASH on the key")
	for _, m := range base {
		require.NotContains(t, m.sql, "USING HASH", "%s: CockroachDB-only DDL belongs in migrations/cockroach", m.name)
		for _, line := range strings.Split(m.sql, "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "--") {
				continue
			}
			require.NotRegexp(t, `(?i)\bINT\b|\bSERIAL\b|\bSEQUENCE\b|\bTRIGGER\b|\bFUNCTION\b`, line,
				"%s: keep the base schema in the SQL both databases accept", m.name)
		}
		require.Contains(t, m.sql, "IF NOT EXISTS", "%s: migrations must be safe to repeat", m.name)
	}
}
