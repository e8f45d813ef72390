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
	base, err := migrations(false)
	require.NoError(t, err)
	require.Equal(t, []string{"base/0001_records.sql", "base/0002_expires_at_index.sql", "base/0003_request_id.sql", "base/0004_lease_us.sql", "base/0005_secrets.sql", "base/0006_parking.sql"}, names(base))

	crdb, err := migrations(true)
	require.NoError(t, err)
	require.Equal(t, []string{"base/0001_records.sql", "cockroach/0002_expires_at_index.sql", "base/0003_request_id.sql", "base/0004_lease_us.sql", "base/0005_secrets.sql", "cockroach/0006_parking.sql"}, names(crdb),
		"the overlay replaces the base file of the same name")
	require.Contains(t, crdb[1].sql, "USING HASH")
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
