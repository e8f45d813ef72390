package postgres

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// unportable are constructs CockroachDB's documentation lists as
// unsupported, or that behave differently there, each with the reason the
// failure gives. The store's SQL must keep to what both engines accept
// (storage/postgres/doc.go; the engine-specific DDL lives in the
// migrations/cockroach overlays).
var unportable = []struct {
	re  *regexp.Regexp
	why string
}{
	{regexp.MustCompile(`(?i)\bpg_(try_)?advisory`), "advisory locks are no-ops on CockroachDB: take a lock row (migrate.go)"},
	{regexp.MustCompile(`(?i)\b(LISTEN|UNLISTEN|NOTIFY)\b|\bpg_notify\s*\(`), "LISTEN/NOTIFY: CockroachDB has no notifications (use a changefeed or polling)"},
	{regexp.MustCompile(`(?i)\b(ctid|xmin|xmax|cmin|cmax)\b`), "PostgreSQL system columns: CockroachDB has none"},
	{regexp.MustCompile(`(?is)\bDELETE\s+FROM\s+\w+(\s+(AS\s+)?\w+)?\s+USING\b`), "DELETE ... USING: unsupported on CockroachDB; use WHERE ... IN (SELECT ...)"},
	{regexp.MustCompile(`(?i)\bpg_current_xact_id|\btxid_current\b|\bpg_stat_activity\b|\bpg_backend_pid\s*\(`), "PostgreSQL-only catalog or function"},
	{regexp.MustCompile(`(?i)\b(nextval|setval|currval)\s*\(|\bCREATE\s+SEQUENCE\b|\bSERIAL\b`), "sequences: a hotspot on CockroachDB and unordered there; tokens come from NextToken"},
	{regexp.MustCompile(`(?i)\bCREATE\s+(OR\s+REPLACE\s+)?(TRIGGER|FUNCTION|PROCEDURE|RULE)\b`), "triggers, functions, rules: not in the subset both engines accept"},
	{regexp.MustCompile(`(?i)\bLOCK\s+TABLE\b`), "LOCK TABLE: unsupported on CockroachDB"},
	{regexp.MustCompile(`(?i)\bUNLOGGED\b|\bINHERITS\b|\bEXCLUDE\s+USING\b`), "PostgreSQL-only table features"},
}

// cockroachOnly may appear in the CockroachDB overlays only: PostgreSQL
// refuses them.
var cockroachOnly = regexp.MustCompile(`(?i)\bUPSERT\b|\bUSING\s+HASH\b|\bAS\s+OF\s+SYSTEM\s+TIME\b|\bunique_rowid\s*\(|\bttl_\w+\s*=|\w+@\w+`)

// recordMutation counts the statements' mutations of idemreg_records: more
// than one in one statement is unsupported on CockroachDB (a table may be
// modified once per statement).
var recordMutation = regexp.MustCompile(`(?i)\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+idemreg_records\b`)

var sqlStart = regexp.MustCompile(`(?i)^\s*(WITH|SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|SET|SHOW)\b`)

// withoutComments drops SQL line comments, which may name what they avoid.
func withoutComments(sql string) string {
	var b strings.Builder
	for _, line := range strings.Split(sql, "\n") {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i]
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	return b.String()
}

// storeSQL returns every SQL text of the package's non-test code: the
// string literals that read as SQL (queries, admin, secrets, usage,
// migrate's lock), by file and line, and the statements as built (the
// prepared set, with their column lists and batch forms).
func storeSQL(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			s, err := strconv.Unquote(lit.Value)
			require.NoError(t, err)
			if sqlStart.MatchString(s) {
				out[fset.Position(lit.Pos()).String()] = s
			}
			return true
		})
	}
	for i, s := range preparedStatements {
		out["preparedStatements["+strconv.Itoa(i)+"]"] = s
	}
	// The admin statements, as built: they are not prepared.
	out["invalidateSQL"], out["resolveSQL"], out["inspectSQL"] = invalidateSQL, resolveSQL, inspectSQL
	out["countParkedFromSQL"], out["countParkedRangeSQL"] = countParkedFromSQL, countParkedRangeSQL
	for v, s := range listSQL {
		out[fmt.Sprintf("listSQL[%+v]", v)] = s
	}
	return out
}

// TestPortableSQL fails when a statement the store sends, or a migration,
// uses a construct CockroachDB's documentation lists as unsupported (issue
// 16): advisory locks, LISTEN/NOTIFY, system columns, DELETE ... USING,
// more than one mutation of idemreg_records in one statement, and so on;
// and when a base migration or a statement uses CockroachDB-only syntax.
func TestPortableSQL(t *testing.T) {
	statements := storeSQL(t)
	require.Contains(t, statements, "preparedStatements[0]")
	require.Greater(t, len(statements), 20, "the scan finds the store's SQL")
	check := func(where, sql string, overlay bool) {
		text := withoutComments(sql)
		for _, u := range unportable {
			require.NotRegexp(t, u.re, text, "%s: %s", where, u.why)
		}
		if !overlay {
			require.NotRegexp(t, cockroachOnly, text, "%s: CockroachDB-only syntax belongs in migrations/cockroach", where)
		}
		require.LessOrEqual(t, len(recordMutation.FindAllString(text, -1)), 1,
			"%s: CockroachDB modifies a table at most once per statement", where)
	}
	for where, sql := range statements {
		check(where, sql, false)
	}
	for _, variant := range []struct{ cockroach, ttl bool }{{false, false}, {true, false}, {true, true}} {
		ms, err := migrations(variant.cockroach, variant.ttl)
		require.NoError(t, err)
		for _, m := range ms {
			check(m.variant+"/"+m.name, m.sql, m.variant != "base")
		}
	}
}

// TestPortableSQLCatches: each rule fails on the construct it names, so
// that a rule that matches nothing does not pass silently.
func TestPortableSQLCatches(t *testing.T) {
	bad := []string{
		`SELECT pg_advisory_xact_lock(1)`,
		`LISTEN idemreg`,
		`SELECT ctid FROM idemreg_records`,
		`DELETE FROM idemreg_records r USING idemreg_secrets s WHERE r.key = s.name`,
		`SELECT pg_current_xact_id_if_assigned()`,
		`SELECT nextval('tokens')`,
		`CREATE OR REPLACE FUNCTION f() RETURNS int AS $$ SELECT 1 $$ LANGUAGE sql`,
		`LOCK TABLE idemreg_records`,
		`CREATE UNLOGGED TABLE x (a BIGINT)`,
	}
	for i, sql := range bad {
		require.Regexp(t, unportable[i].re, sql)
	}
	two := `WITH a AS (DELETE FROM idemreg_records WHERE key = 'x' RETURNING 1)
UPDATE idemreg_records SET attempt = 2 WHERE key = 'y'`
	require.Len(t, recordMutation.FindAllString(two, -1), 2)
	require.Regexp(t, cockroachOnly, `UPSERT INTO idemreg_records VALUES (1)`)
	require.Regexp(t, cockroachOnly, `DROP INDEX idemreg_records@idemreg_records_expires_at`)
	require.NotRegexp(t, unportable[2].re, withoutComments("SELECT 1 -- not ctid"))
}
