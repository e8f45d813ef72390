package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// insertRecords writes n in-progress records of consumer with keys
// k00000... straight into the table, and parks every parkEvery-th (0: none).
func insertRecords(t *testing.T, conn *pgx.Conn, consumer string, n, parkEvery int) {
	t.Helper()
	_, err := conn.Exec(t.Context(), `
INSERT INTO idemreg_records (consumer, kind, key, state, fingerprint, token, attempt, holder, created_at,
    lease_expires_at, expires_at, retention_us, park_reason)
SELECT $1, 1, 'k' || lpad(CAST(g AS TEXT), 5, '0'),
    CASE WHEN $3 > 0 AND g % $3 = 0 THEN 3 ELSE 1 END, '', g, 1, 'h', now(),
    now() + INTERVAL '1 hour', now() + INTERVAL '2 hours', 3600000000,
    CASE WHEN $3 > 0 AND g % $3 = 0 THEN 'p' ELSE '' END
FROM generate_series(1, $2) AS g`, consumer, n, parkEvery)
	require.NoError(t, err)
}

// planNode is the part of EXPLAIN (FORMAT JSON) the plan test reads.
type planNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	IndexName string     `json:"Index Name"`
	Plans     []planNode `json:"Plans"`
}

// scansOf lists "node type/index" for every node of the plan that reads
// idemreg_records; a bitmap heap scan is listed with the index its bitmap
// index scan reads.
func scansOf(n planNode) []string {
	var out []string
	if n.Relation == "idemreg_records" {
		index := n.IndexName
		if n.NodeType == "Bitmap Heap Scan" && len(n.Plans) == 1 {
			index = n.Plans[0].IndexName
		}
		out = append(out, n.NodeType+"/"+index)
	}
	for _, c := range n.Plans {
		out = append(out, scansOf(c)...)
	}
	return out
}

// literal renders a test argument for EXECUTE.
func literal(v any) string {
	switch v := v.(type) {
	case string:
		return "'" + strings.ReplaceAll(v, "'", "''") + "'"
	case int:
		return strconv.Itoa(v)
	}
	panic(fmt.Sprintf("literal %T", v))
}

// TestListPlans: on PostgreSQL, each List statement reads the index its
// variant is for, in key order so that its LIMIT bounds the read, under a
// custom plan and under the generic plan a prepared statement may switch
// to after five runs: the parked variants read the partial index of parked
// records (the reason their text states its predicate), the others the
// primary key. Nothing reads the table sequentially. CountParked reads the
// parked index, in any order.
func TestListPlans(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	pgtest.RequirePostgreSQL(t, databaseURL, "reads PostgreSQL's EXPLAIN output and plan_cache_mode")
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	insertRecords(t, conn, "plan.a", 20000, 2000)
	insertRecords(t, conn, "plan.b", 20000, 0)
	insertRecords(t, conn, "other", 20000, 0)
	insertRecords(t, conn, "zz.parked", 20000, 1)
	_, err = conn.Exec(t.Context(), `ANALYZE idemreg_records`)
	require.NoError(t, err)

	// $1 consumer, $2-$4 after, $5 scan, $6 limit, $7 state, $8 min
	// attempt, $9 older than, $10 offset, $11 the prefix's end.
	listArgs := func(consumer string, state int, end ...string) []string {
		args := []string{literal(consumer), literal(consumer), "-1", "''", "1000", "100", literal(state), "0", "0", "0"}
		for _, e := range end {
			args = append(args, literal(e))
		}
		return args
	}
	// Where the index holds few entries of the range, reading them all
	// through a bitmap and sorting them is cheaper, and reads few; where it
	// holds many, only an ordered scan stops at the LIMIT.
	ordered := []string{"Index Scan", "Index Only Scan"}
	few := append([]string{"Bitmap Heap Scan"}, ordered...)
	for _, tc := range []struct {
		name  string
		sql   string
		args  []string
		index string
		scans []string
	}{
		{"exact", postgres.ListSQL("exact", false), listArgs("plan.a", 0), "idemreg_records_pkey", ordered},
		{"exact, completed", postgres.ListSQL("exact", false), listArgs("plan.a", 2), "idemreg_records_pkey", ordered},
		{"exact, parked", postgres.ListSQL("exact", true), listArgs("plan.a", 3), "idemreg_records_parked", few},
		{"exact, many parked", postgres.ListSQL("exact", true), listArgs("zz.parked", 3), "idemreg_records_parked", ordered},
		{"prefix", postgres.ListSQL("range", false), listArgs("plan.", 0, "plan/"), "idemreg_records_pkey", ordered},
		{"prefix, parked", postgres.ListSQL("range", true), listArgs("plan.", 3, "plan/"), "idemreg_records_parked", few},
		{"every consumer", postgres.ListSQL("from", false), listArgs("", 0), "idemreg_records_pkey", ordered},
		{"every consumer, parked", postgres.ListSQL("from", true), listArgs("", 3), "idemreg_records_parked", ordered},
		{"count parked", postgres.CountParkedRangeSQL, []string{literal("plan."), "0", literal("plan/")}, "idemreg_records_parked", few},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				_, err := conn.Exec(t.Context(), "SET plan_cache_mode = "+mode)
				require.NoError(t, err)
				_, err = conn.Exec(t.Context(), "PREPARE q AS "+tc.sql)
				require.NoError(t, err)
				defer conn.Exec(context.Background(), "DEALLOCATE q") //nolint:errcheck // the next case prepares q again
				var out []byte
				err = conn.QueryRow(t.Context(), "EXPLAIN (FORMAT JSON) EXECUTE q("+strings.Join(tc.args, ", ")+")",
					pgx.QueryExecModeSimpleProtocol).Scan(&out)
				require.NoError(t, err)
				var plans []struct {
					Plan planNode `json:"Plan"`
				}
				require.NoError(t, json.Unmarshal(out, &plans))
				require.Len(t, plans, 1)
				scans := scansOf(plans[0].Plan)
				require.NotEmpty(t, scans)
				var allowed []string
				for _, scan := range tc.scans {
					allowed = append(allowed, scan+"/"+tc.index)
				}
				for _, s := range scans {
					require.Contains(t, allowed, s, "every read of the table is one of %v: %v", allowed, scans)
				}
			})
		}
	}
}

// TestListNext pins where a page says the next one starts: after its last
// record when it is full; else after the last index entry it read when it
// read its whole window (storage.ListScanLimit); else nowhere.
func TestListNext(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL)
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	const consumer = "next"
	insertRecords(t, conn, consumer, 1005, 0)
	key := func(i int) *storage.Key {
		return &storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: fmt.Sprintf("k%05d", i)}
	}
	scan := storage.ListScanLimit(10)
	require.Equal(t, 1000, scan)

	page, err := s.List(t.Context(), storage.ListParams{Consumer: consumer, Limit: 10})
	require.NoError(t, err)
	require.Len(t, page.Records, 10)
	require.Equal(t, key(10), page.Next, "a full page: after its last record")
	require.WithinDuration(t, time.Now(), page.Now, time.Minute)

	page, err = s.List(t.Context(), storage.ListParams{Consumer: consumer, State: storage.StateCompleted, Limit: 10})
	require.NoError(t, err)
	require.Empty(t, page.Records)
	require.Equal(t, key(scan), page.Next, "a whole window read: after its last entry")
	require.False(t, page.Now.IsZero(), "an empty page still reads the clock")

	page, err = s.List(t.Context(), storage.ListParams{Consumer: consumer, State: storage.StateCompleted, Limit: 10, After: page.Next})
	require.NoError(t, err)
	require.Empty(t, page.Records)
	require.Nil(t, page.Next, "the range ended within the window")

	page, err = s.List(t.Context(), storage.ListParams{Consumer: consumer, Limit: 10, After: key(1000)})
	require.NoError(t, err)
	require.Len(t, page.Records, 5)
	require.Nil(t, page.Next, "a short page whose window the range ended in")

	page, err = s.List(t.Context(), storage.ListParams{Consumer: consumer, Limit: 5, After: key(1000)})
	require.NoError(t, err)
	require.Len(t, page.Records, 5)
	require.Equal(t, key(1005), page.Next, "full, even though nothing follows: the next page is empty and ends it")

	_, err = s.List(t.Context(), storage.ListParams{Consumer: consumer})
	require.ErrorContains(t, err, "not positive")
}

// TestListPrefixBounds lists and counts by prefixes that a LIKE pattern or
// a byte-wise increment would get wrong: LIKE metacharacters, a
// multi-byte last character, and a last character with no successor. It
// also pins the collation doc.go assumes: code point order, so "B" lists
// before "a".
func TestListPrefixBounds(t *testing.T) {
	var clock storagetest.Clock
	s := openStore(t, pgtest.NewDatabase(t), postgres.WithClockOffset(clock.Offset))
	consumers := []string{"B", "a", "p%_x", "p%_y", "pa_", "caf\u00e9.1", "caf\u00e9", "caf\u00ea", "z\U0010FFFF", "z\U0010FFFF.1", "{"}
	for _, c := range consumers {
		k := storage.Key{Consumer: c, Kind: storage.KindOperation, Key: "k"}
		res, err := s.Claim(t.Context(), storage.ClaimParams{Key: k, Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		_, err = s.Park(t.Context(), storage.ParkParams{Key: k, Token: res.Record.Token, Reason: "p"})
		require.NoError(t, err)
	}
	listed := func(prefix string, state storage.State) []string {
		var out []string
		p := storage.ListParams{Consumer: prefix, Prefix: true, State: state, Limit: 2}
		for range 20 {
			page, err := s.List(t.Context(), p)
			require.NoError(t, err)
			for _, r := range page.Records {
				out = append(out, r.Consumer)
			}
			if page.Next == nil {
				return out
			}
			p.After = page.Next
		}
		t.Fatal("the listing did not end")
		return nil
	}
	for _, tc := range []struct {
		prefix string
		want   []string
	}{
		{"", []string{"B", "a", "caf\u00e9", "caf\u00e9.1", "caf\u00ea", "p%_x", "p%_y", "pa_", "z\U0010FFFF", "z\U0010FFFF.1", "{"}},
		{"p%_", []string{"p%_x", "p%_y"}},
		{"caf\u00e9", []string{"caf\u00e9", "caf\u00e9.1"}},
		{"z\U0010FFFF", []string{"z\U0010FFFF", "z\U0010FFFF.1"}},
		{"\U0010FFFF", nil},
	} {
		for _, state := range []storage.State{0, storage.StateParked} {
			require.Equal(t, tc.want, listed(tc.prefix, state), "prefix %q, state %d", tc.prefix, state)
		}
		counts, err := s.CountParked(t.Context(), tc.prefix)
		require.NoError(t, err)
		want := map[string]int64{}
		for _, c := range tc.want {
			want[c] = 1
		}
		require.Equal(t, want, counts, "prefix %q", tc.prefix)
	}
}

// TestHistoryKeepsText: the history column is JSON built by the database:
// holders and reasons with quotes, backslashes, newlines and non-ASCII
// text come back as they were, and a takeover in a batched statement
// appends as a single one does.
func TestHistoryKeepsText(t *testing.T) {
	var clock storagetest.Clock
	s := openStore(t, pgtest.NewDatabase(t), postgres.WithClockOffset(clock.Offset))
	holder := "h \"quoted\" \\ back\nslash é 🙂"
	k := storage.Key{Consumer: "text", Kind: storage.KindOperation, Key: "k"}
	k2 := storage.Key{Consumer: "text", Kind: storage.KindOperation, Key: "k2"}
	var first []storage.ClaimResult
	for _, key := range []storage.Key{k, k2} {
		res, err := s.Claim(t.Context(), storage.ClaimParams{Key: key, Holder: holder, Lease: time.Second, Retention: time.Hour})
		require.NoError(t, err)
		first = append(first, res)
	}
	clock.Advance(2 * time.Second)
	answers := s.ClaimBatch(t.Context(), []storage.ClaimParams{
		{Key: k, Holder: "next", Lease: time.Second, Retention: time.Hour},
		{Key: k2, Holder: "next", Lease: time.Second, Retention: time.Hour},
	})
	for i, ans := range answers {
		require.NoError(t, ans.Err)
		require.Equal(t, storage.OutcomeAcquired, ans.Result.Outcome)
		got, err := s.Inspect(t.Context(), ans.Result.Record.Key)
		require.NoError(t, err)
		require.Equal(t, []storage.Attempt{{Attempt: 1, Token: first[i].Record.Token, Holder: holder,
			EndedAt: first[i].Record.LeaseExpiresAt, End: storage.AttemptTakenOver}}, got.Record.History)
	}

	reason := "it's \"done\"\n\tby hand — ✓"
	_, err := s.Invalidate(t.Context(), storage.InvalidateParams{Key: k, Reason: reason})
	require.NoError(t, err)
	got, err := s.Inspect(t.Context(), k)
	require.NoError(t, err)
	require.Len(t, got.Record.History, 2)
	require.Equal(t, reason, got.Record.History[1].Note)
	require.Equal(t, "next", got.Record.History[1].Holder)
	require.True(t, got.Record.History[1].EndedAt.Equal(got.Record.LeaseExpiresAt), "invalidated when its lease was ended")
}
