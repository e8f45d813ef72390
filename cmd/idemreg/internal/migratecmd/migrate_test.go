package migratecmd

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestMigrateListsWhatItApplied runs migrate and migrate status against a
// real PostgreSQL: migrate names each migration it applies and the schema
// version, and says "up to date" only when it applied none; migrate status
// lists applied and pending migrations and exits 3 while any is pending.
func TestMigrateListsWhatItApplied(t *testing.T) {
	db := pgtest.NewEmptyDatabase(t)
	_, pending, err := postgres.MigrationStatus(t.Context(), db)
	require.NoError(t, err)
	all := len(pending) // the migrations are numbered 1 to all
	require.Equal(t, all, pending[all-1].Version())
	cmd := func(args ...string) (string, error) {
		run := Migrate
		if len(args) > 1 && args[1] == "status" {
			run = Status
		}
		fs := flag.NewFlagSet(strings.Join(args, " "), flag.ContinueOnError)
		exec := run(fs)
		require.NoError(t, cmdline.Parse(fs, []string{"--database-url", db}))
		var stdout bytes.Buffer
		err := exec(t.Context(), &stdout, io.Discard)
		return stdout.String(), err
	}
	exitCode := func(err error) int {
		if code, ok := command.Status(err); ok {
			return code
		}
		require.NoError(t, err)
		return 0
	}

	out, err := cmd("migrate", "status")
	require.Equal(t, ExitPending, exitCode(err), "%v", err)
	require.ErrorContains(t, err, fmt.Sprintf("%d migrations pending: run idemreg migrate", all))
	require.Regexp(t, `^MIGRATION +VARIANT +STATE +APPLIED AT\n`, out)
	require.Equal(t, all, strings.Count(out, " pending "), out)
	require.Contains(t, out, fmt.Sprintf("schema at version 0, %d migrations pending", all))

	out, err = cmd("migrate")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, all+1, out)
	require.Equal(t, "applied 0001_records.sql (base)", lines[0])
	for _, l := range lines[:all] {
		require.Regexp(t, `^applied \d{4}_\w+\.sql \(base\)$`, l)
	}
	require.Regexp(t, fmt.Sprintf(`^schema at version %d \(%d migrations applied now\): postgres://`, all, all), lines[all])
	require.NotContains(t, out, "up to date")

	out, err = cmd("migrate")
	require.NoError(t, err)
	require.Regexp(t, fmt.Sprintf(`^schema is up to date at version %d: postgres://\S+\n$`, all), out, "nothing applied, and it says so")

	out, err = cmd("migrate", "status")
	require.Zero(t, exitCode(err))
	require.Equal(t, all, strings.Count(out, " applied "), out)
	require.Regexp(t, `(?m)^0001_records\.sql +base +applied +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$`, out)
	require.NotContains(t, out, "pending")
	require.Contains(t, out, fmt.Sprintf("schema is up to date at version %d", all))

	// A binary newer than the schema: the last migration is pending, and
	// migrate applies it alone.
	conn, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	defer conn.Close(t.Context())
	var last string
	require.NoError(t, conn.QueryRow(t.Context(), `DELETE FROM idemreg_schema_migrations WHERE name = (SELECT max(name) FROM idemreg_schema_migrations) RETURNING name`).Scan(&last))
	out, err = cmd("migrate", "status")
	require.Equal(t, ExitPending, exitCode(err))
	require.ErrorContains(t, err, "1 migration pending")
	require.Regexp(t, `(?m)^`+last+` +base +pending +-$`, out)
	require.Contains(t, out, fmt.Sprintf("schema at version %d, 1 migration pending", all-1))
	out, err = cmd("migrate")
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("applied %s (base)\n", last), strings.SplitAfter(out, "\n")[0])
	require.Contains(t, out, fmt.Sprintf("schema at version %d (1 migration applied now)", all))
}
