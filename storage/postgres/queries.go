package postgres

import (
	"fmt"
	"strings"

	"github.com/idemreg/idemreg/storage"
)

// The statements below are the whole of the store's SQL. Each RPC runs one
// of them as one implicit transaction: the conditional write and the read of
// the record it did not write travel together, so there is no window between
// a read and a write, and the database's clock is the only clock.
//
// The writing statements come from two templates, claimStatement and
// fencedStatement, each of which makes the single-row form and the batched
// form of a statement from the same text; only the input differs. The
// input is a CTE i with one row per call and its ordinal i.ord: one row of
// scalar parameters for a single call (single), or arrays unnested in step
// for a batch (batch). Every output row carries the ordinal, so each call
// gets the answer for its own key. Shape:
//
//	WITH clock AS (SELECT now() + offset AS now),
//	     i     AS (<input>),
//	     w     AS (<conditional INSERT or UPDATE> RETURNING <record>)
//	SELECT i.ord, true,  clock.now, <record> FROM w JOIN i ON <same key>
//	UNION ALL
//	SELECT i.ord, false, clock.now, <record> FROM <pre-image> WHERE NOT EXISTS (<w wrote that key>)
//
// The second branch is the pre-image: the row as the statement's snapshot
// saw it, for the keys w wrote nothing for. The Go side hands it to the
// storage.Decide* function, which classifies the answer; if that function
// says it would have written, the row changed after the statement's
// snapshot and the statement runs again (doc.go, "Isolation").
//
// The predicates that decide a write are built from the functions below,
// each named after the rule in storage/rules.go it is, so that a reader can
// check a statement against the rules by name. Durations travel as
// microsecond BIGINTs and are turned into intervals by multiplying
// INTERVAL '1 microsecond', which both PostgreSQL and CockroachDB accept;
// timestamps are microsecond-precise on both, so the arithmetic is exact.

// The rules, in SQL: r is a record's alias, now a timestamp expression.

// live is Record.Live: the record counts as present.
func live(r, now string) string { return r + ".expires_at > " + now }

// leaseLive is Record.LeaseLive.
func leaseLive(r, now string) string { return r + ".lease_expires_at > " + now }

// completed is State == StateCompleted.
func completed(r string) string { return r + ".state = 2" }

// parked is State == StateParked.
func parked(r string) string { return r + ".state = 3" }

// notFinal is the state check of Complete, Release, Extend and Park (the
// rules' notFinal): neither completed nor parked, so in progress.
func notFinal(r string) string { return r + ".state = 1" }

// attemptsExhausted is storage.AttemptsExhausted: a positive max_attempts
// that the record's attempt has reached.
func attemptsExhausted(r, maxAttempts string) string {
	return fmt.Sprintf("(%[2]s > 0 AND %[1]s.attempt >= %[2]s)", r, maxAttempts)
}

// fingerprintsConflict is storage.FingerprintsConflict: both fingerprints
// are set and differ.
func fingerprintsConflict(stored, given string) string {
	return fmt.Sprintf("(octet_length(%[1]s) > 0 AND octet_length(%[2]s) > 0 AND %[1]s <> %[2]s)", stored, given)
}

// nextToken is storage.NextToken(prev, now): max(prev+1, now in µs).
func nextToken(prev, now string) string {
	return fmt.Sprintf("GREATEST(%s + 1, %s)", prev, epochMicros(now))
}

// epochMicros is a timestamp as microseconds since the epoch: the unit of
// tokens (storage.AcquiredAt reads one as a time) and of the history's
// times.
func epochMicros(ts string) string {
	return fmt.Sprintf("CAST(extract(epoch FROM %s) * 1000000 AS BIGINT)", ts)
}

// ended is storage's ended(cur, at, end, note): the attempt the record r
// holds, ended at the timestamp at by end, with note, as one element of the
// history column (historyEntry in admin.go reads it back).
func ended(r, at string, end storage.AttemptEnd, note string) string {
	return fmt.Sprintf("jsonb_build_object('a', %[1]s.attempt, 't', %[1]s.token, 'h', %[1]s.holder, 'e', %[2]s, 'n', %[3]d, 'p', %[1]s.park_reason, 'o', %[4]s)",
		r, epochMicros(at), end, note)
}

// appendHistory is storage's appendHistory: the history h with entry
// appended, its oldest entry dropped when h already holds MaxHistory. Every
// write of the column goes through here, so h never holds more than
// MaxHistory and dropping one entry is enough.
func appendHistory(h, entry string) string {
	return fmt.Sprintf("(CASE WHEN jsonb_array_length(%[1]s) >= %[3]d THEN %[1]s - 0 ELSE %[1]s END) || jsonb_build_array(%[2]s)",
		h, entry, storage.MaxHistory)
}

// tokenHeld is DecideClaim's "cur.Lease > 0": a Claim acquired the
// record's token, which an operator's fresh token (lease 0) was not.
func tokenHeld(r string) string { return "(" + r + ".lease_us > 0)" }

// noHistory is the history of a fresh record.
const noHistory = "CAST('[]' AS JSONB)"

// fenced is the check of Complete, Release and Extend (storage's fenced):
// the record is live and token is its current token.
func fenced(r, now, token string) string {
	return live(r, now) + " AND " + r + ".token = " + token
}

// micros turns a microsecond BIGINT expression into an interval.
func micros(us string) string { return "(" + us + ") * INTERVAL '1 microsecond'" }

// sameKey joins two aliases on the record key.
func sameKey(a, b string) string {
	return fmt.Sprintf("%[1]s.consumer = %[2]s.consumer AND %[1]s.kind = %[2]s.kind AND %[1]s.key = %[2]s.key", a, b)
}

// param is one argument of a statement: its position ($n), its column in
// the input i, and its SQL type.
type param struct {
	n          int
	name, kind string
}

// single is the input of a single call: one row of scalar parameters,
// ordinal 1, inlined where it is used (NOT MATERIALIZED, which both
// databases accept), so that the planner sees the parameters themselves:
// materialized, it cost the Claim statement about a tenth of its
// throughput.
func single(params ...param) string {
	cols := make([]string, len(params))
	for j, p := range params {
		cols[j] = fmt.Sprintf("CAST($%d AS %s) AS %s", p.n, p.kind, p.name)
	}
	return "NOT MATERIALIZED (SELECT " + strings.Join(cols, ", ") + ", CAST(1 AS BIGINT) AS ord)"
}

// batch is the input of a batch: one array per parameter, unnested in step,
// with the ordinal of each element.
func batch(params ...param) string {
	arrays, names := make([]string, len(params)), make([]string, len(params))
	for j, p := range params {
		arrays[j] = fmt.Sprintf("CAST($%d AS %s[])", p.n, p.kind)
		names[j] = p.name
	}
	return "(SELECT * FROM unnest(" + strings.Join(arrays, ", ") + ") WITH ORDINALITY AS i(" + strings.Join(names, ", ") + ", ord))"
}

// clock is the statement's clock: the database's, plus the offset tests
// inject (parameter n, µs).
func clock(n int) string {
	return fmt.Sprintf("clock AS (\n    SELECT %s AS now\n)", clockExpr(n))
}

// clockExpr is the clock as an expression: now() is the transaction's
// start, the same wherever the statement reads it.
func clockExpr(n int) string {
	return "(now() + " + micros(fmt.Sprintf("CAST($%d AS BIGINT)", n)) + ")"
}

// inlineClock is a statement written over the clock CTE (clock(n), joined
// as c) with the clock read inline instead: the same value, and a plan
// without the CTE and the joins on it, which every execution initialises
// (executor start-up was a fifth of a Claim's database CPU;
// docs/benchmarks.md, "Small batches").
func inlineClock(sql string, n int) string {
	sql = strings.Replace(sql, "WITH "+clock(n)+",\n", "WITH ", 1)
	sql = strings.ReplaceAll(sql, " CROSS JOIN clock c", "")
	return strings.ReplaceAll(sql, "c.now", clockExpr(n))
}

// recordColumns is the column list every statement returns, in scan order.
const recordColumns = `consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result, request_id, lease_us, park_reason`

// Claim: $1 consumer, $2 kind, $3 key, $4 fingerprint, $5 holder, $6 lease
// µs, $7 retention µs, $9 request id, $10 max attempts (0: none) (arrays
// for a batch), $8 clock offset µs. A batch's keys are distinct: PostgreSQL refuses an ON CONFLICT DO
// UPDATE that affects a row twice.
var claimParams = []param{
	{1, "consumer", "TEXT"}, {2, "kind", "SMALLINT"}, {3, "key", "TEXT"}, {4, "fingerprint", "BYTEA"},
	{5, "holder", "TEXT"}, {6, "lease_us", "BIGINT"}, {7, "retention_us", "BIGINT"}, {9, "request_id", "TEXT"},
	{10, "max_attempts", "BIGINT"},
}

var (
	claimSQL      = claimStatement(single(claimParams...))
	claimBatchSQL = claimStatement(batch(claimParams...))
)

// claimStatement is the Claim of every row of input. cur is the row as the
// statement's snapshot sees it. The INSERT proposes a fresh record
// (DecideClaim on an absent key) only for the inputs whose cur does not
// already decide the answer without a write (claimAnswersWithoutWrite: a
// live completed record, a live lease, a fingerprint conflict): a replay or
// an in-progress answer then takes no row lock, and a statement of only
// such answers gets no transaction id and commits without a WAL flush. On
// a conflict (a row the snapshot did not see, or one cur says may be
// replaced), excluded.created_at is the statement's clock reading, and the
// UPDATE's WHERE is DecideClaim's write condition, evaluated on the latest
// row. The pre-image is cur. Rows are locked in the input's order, which
// the batcher sorts by key, so concurrent batches rarely deadlock.
func claimStatement(input string) string {
	return inlineClock(`
WITH `+clock(8)+`,
i AS `+input+`,
cur AS (
    SELECT i.ord, `+recordColumnsOf("r")+`
    FROM i JOIN idemreg_records r ON `+sameKey("r", "i")+`
),
w AS (
    INSERT INTO idemreg_records AS r (`+recordColumns+`, max_attempts)
    SELECT i.consumer, i.kind, i.key,
        1,                                        -- StateInProgress
        i.fingerprint,
        `+nextToken("0", "c.now")+`,  -- NextToken(0, now)
        1,                                        -- Attempt
        i.holder,
        c.now,                                    -- CreatedAt
        c.now + `+micros("i.lease_us")+`,                 -- now + Lease
        NULL,
        c.now + `+micros("i.lease_us + i.retention_us")+`,  -- now + Lease + Retention
        i.retention_us,
        NULL,
        i.request_id,
        i.lease_us,                               -- Lease
        '',                                       -- ParkReason
        i.max_attempts                            -- read back as excluded.max_attempts
    FROM i CROSS JOIN clock c
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.ord = i.ord AND `+claimAnswersWithoutWrite("cur", "c.now", "i.fingerprint")+`)
    ORDER BY i.ord
`+claimOnConflict+`    RETURNING `+recordColumnsOf("r")+`
)
SELECT i.ord, true, c.now, `+recordColumnsOf("w")+`
FROM w JOIN i ON `+sameKey("w", "i")+` CROSS JOIN clock c
UNION ALL
SELECT cur.ord, false, c.now, `+recordColumnsOf("cur")+`
FROM cur CROSS JOIN clock c
WHERE NOT EXISTS (SELECT 1 FROM w WHERE `+sameKey("w", "cur")+`)`, 8)
}

// claimAnswersWithoutWrite is the negation of DecideClaim's write
// condition (claimOnConflict's WHERE) for the record alias r at now with
// the given fingerprint: the record is live, and completed or parked, or
// its lease is live, or its fingerprint conflicts.
func claimAnswersWithoutWrite(r, now, fingerprint string) string {
	return live(r, now) + " AND (" + completed(r) + " OR " + parked(r) + " OR " + leaseLive(r, now) + " OR " +
		fingerprintsConflict(r+".fingerprint", fingerprint) + ")"
}

// claimOnConflict is the conflict branch of the Claim statement: on a
// conflict, excluded.created_at is the statement's clock reading (now),
// excluded.max_attempts the Claim's MaxAttempts (an ON CONFLICT UPDATE sees
// only the row and excluded, so the Claim's bound travels in the proposed
// row's max_attempts column), and the UPDATE's WHERE is DecideClaim's write
// condition on the latest row: !cur.Live(now), or the takeover (not
// completed, not parked, lease over, no fingerprint conflict). A record
// that is not live counts as absent and is replaced by a fresh one; a
// takeover keeps the record and hands it to the caller, unless its
// attempts are exhausted (claimParks), when the record is parked as it is
// (storage's park). The history the takeover appends to is written and not
// returned: only Inspect and List read it, and the answers of the other
// statements stay small (see fencedStatement).
var claimOnConflict = `    ON CONFLICT (consumer, kind, key) DO UPDATE SET
        state            = CASE WHEN ` + claimParks + ` THEN 3 ELSE excluded.state END,  -- park: StateParked
        -- takeover: "if len(rec.Fingerprint) == 0 { rec.Fingerprint = p.Fingerprint }"; park keeps it
        fingerprint      = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) OR (octet_length(r.fingerprint) = 0 AND NOT ` + claimParks + `)
                                THEN excluded.fingerprint ELSE r.fingerprint END,
        -- NextToken(cur.Token, now), both cases; park keeps the token
        token            = CASE WHEN ` + claimParks + ` THEN r.token ELSE ` + nextToken("r.token", "excluded.created_at") + ` END,
        -- takeover: Attempt = cur.Attempt + 1; park keeps it
        attempt          = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) THEN 1 WHEN ` + claimParks + ` THEN r.attempt ELSE r.attempt + 1 END,
        holder           = CASE WHEN ` + claimParks + ` THEN r.holder ELSE excluded.holder END,
        request_id       = CASE WHEN ` + claimParks + ` THEN r.request_id ELSE excluded.request_id END,
        lease_us         = CASE WHEN ` + claimParks + ` THEN r.lease_us ELSE excluded.lease_us END,
        -- a takeover keeps CreatedAt
        created_at       = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) THEN excluded.created_at ELSE r.created_at END,
        lease_expires_at = CASE WHEN ` + claimParks + ` THEN r.lease_expires_at ELSE excluded.lease_expires_at END,
        completed_at     = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) THEN NULL ELSE r.completed_at END,
        -- park: ExpiresAt = now + cur.Retention
        expires_at       = CASE WHEN ` + claimParks + ` THEN excluded.created_at + ` + micros("r.retention_us") + ` ELSE excluded.expires_at END,
        retention_us     = CASE WHEN ` + claimParks + ` THEN r.retention_us ELSE excluded.retention_us END,
        result           = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) THEN NULL ELSE r.result END,
        park_reason      = CASE WHEN ` + claimParks + ` THEN '` + storage.ParkReasonMaxAttempts + `' ELSE '' END,
        max_attempts     = excluded.max_attempts,
        -- the replicas that waited for the attempt that ended: told by
        -- whoever ended it (fencedStatement), or they re-decide at the
        -- lease's end, as this Claim did
        waiters          = NULL,
        -- takeover: the attempt taken over ended when its lease did, if
        -- someone held its token; a fresh record has no history, and park
        -- appends nothing
        history          = CASE WHEN NOT (` + live("r", "excluded.created_at") + `) THEN ` + noHistory + `
                                WHEN ` + claimParks + ` OR NOT ` + tokenHeld("r") + ` THEN r.history
                                ELSE ` + appendHistory("r.history", ended("r", "r.lease_expires_at", storage.AttemptTakenOver, "CAST('' AS TEXT)")) + ` END
    WHERE NOT (` + live("r", "excluded.created_at") + `)
       OR (NOT ` + completed("r") + ` AND NOT ` + parked("r") + ` AND NOT ` + leaseLive("r", "excluded.created_at") + `
           AND NOT ` + fingerprintsConflict("r.fingerprint", "excluded.fingerprint") + `)
`

// claimParks is, within claimOnConflict, DecideClaim's choice to park
// rather than take over: the row is live (so the write is a takeover) and
// AttemptsExhausted(cur, p.MaxAttempts).
var claimParks = "(" + live("r", "excluded.created_at") + " AND " + attemptsExhausted("r", "excluded.max_attempts") + ")"

// fencedStatement is a conditional UPDATE of every row of input (Complete,
// Release, Extend, Invalidate): set is its SET list and where its condition
// beyond the key, both over the record r, the input i and the clock c. The
// written branch returns the record without its result (the caller of a
// Complete sent it; Release and Extend answer none), which keeps answers
// small enough for CockroachDB to retry the statement server-side;
// preImage is the columns of the pre-image (recordColumnsOf("r") where a
// repeat must see the stored result).
//
// The written branch also returns the record's waiters column, last: the
// replicas with a Claim waiting for the attempt this write ends
// (markWaitingSQL), which the server tells (storage.Record.Waiters). It is
// read in the same statement, so a write nobody waits for costs nothing
// more than a NULL in its answer; the pre-image carries NULL (nothing was
// ended). The column is not cleared here (PostgreSQL's RETURNING shows the
// new row, so clearing it would hide it): the next Claim that acquires the
// record clears it (claimOnConflict).
func fencedStatement(offset int, input, set, where, preImage string) string {
	return inlineClock(`
WITH `+clock(offset)+`,
i AS `+input+`,
w AS (
    UPDATE idemreg_records AS r SET
`+set+`
    FROM i CROSS JOIN clock c
    WHERE `+sameKey("r", "i")+`
      AND `+where+`
    RETURNING `+recordColumnsNoResultOf("r")+`, r.waiters
)
SELECT i.ord, true, c.now, `+recordColumnsOf("w")+`, w.waiters
FROM w JOIN i ON `+sameKey("w", "i")+` CROSS JOIN clock c
UNION ALL
SELECT i.ord, false, c.now, `+preImage+`, CAST(NULL AS TEXT[]) AS waiters
FROM i JOIN idemreg_records r ON `+sameKey("r", "i")+` CROSS JOIN clock c
WHERE NOT EXISTS (SELECT 1 FROM w WHERE `+sameKey("w", "i")+`)`, offset)
}

// Complete: $1 consumer, $2 kind, $3 key, $4 token, $5 result (arrays for
// a batch), $6 clock offset µs. A repeated Complete is answered from the
// pre-image, which carries the stored result (the first result stays).
var completeParams = []param{
	{1, "consumer", "TEXT"}, {2, "kind", "SMALLINT"}, {3, "key", "TEXT"}, {4, "token", "BIGINT"}, {5, "result", "BYTEA"},
}

var (
	completeSet = `        state        = 2,             -- StateCompleted
        result       = i.result,
        completed_at = c.now,
        expires_at   = c.now + ` + micros("r.retention_us") + `  -- now + cur.Retention`
	completeWhere = fenced("r", "c.now", "i.token") + `
      AND ` + notFinal("r") + `  -- a repeat is not written, a parked record is refused`
	completeSQL      = fencedStatement(6, single(completeParams...), completeSet, completeWhere, recordColumnsOf("r"))
	completeBatchSQL = fencedStatement(6, batch(completeParams...), completeSet, completeWhere, recordColumnsOf("r"))
)

// releaseSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 clock offset µs.
// A lease that already ended is not written.
var releaseSQL = fencedStatement(5,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"}),
	`        lease_expires_at = c.now`,
	fenced("r", "c.now", "i.token")+" AND "+notFinal("r")+" AND "+leaseLive("r", "c.now"),
	recordColumnsNoResultOf("r"))

// extendSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 lease µs (0: the
// record's own), $6 clock offset µs, $7 default lease µs (for a record
// without one), $8 max lease total µs (0: none).
var extendSQL = fencedStatement(6,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"},
		param{5, "lease_us", "BIGINT"}, param{7, "default_lease_us", "BIGINT"}, param{8, "max_lease_total_us", "BIGINT"}),
	`        -- LeaseExpiresAt = now + ExtendLease(cur, p)
        lease_expires_at = c.now + `+micros(extendLease)+`,
        lease_us         = `+extendLease+`,
        -- ExpiresAt = max(cur.ExpiresAt, now + ExtendLease(cur, p) + cur.Retention)
        expires_at       = GREATEST(r.expires_at, c.now + `+micros(extendLease+" + r.retention_us")+`)`,
	fenced("r", "c.now", "i.token")+" AND "+notFinal("r")+`
      AND `+leaseWithinTotal("r", "c.now", "i.max_lease_total_us"),
	recordColumnsNoResultOf("r"))

// parkSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 reason, $6 clock
// offset µs. A parked record is not written again (the first reason stays).
var parkSQL = fencedStatement(6,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"},
		param{5, "reason", "TEXT"}),
	`        state       = 3,             -- StateParked
        park_reason = i.reason,
        expires_at  = c.now + `+micros("r.retention_us")+`  -- now + cur.Retention`,
	fenced("r", "c.now", "i.token")+" AND "+notFinal("r"),
	recordColumnsNoResultOf("r"))

// leaseWithinTotal is the bound of storage.DecideExtend: no bound, or
// now + ExtendLease(cur, p) is not after LeaseNotAfter(cur, max), the
// record's token read as microseconds since the epoch plus the bound.
func leaseWithinTotal(r, now, maxUs string) string {
	return fmt.Sprintf("(%[1]s = 0 OR %[2]s + %[3]s <= to_timestamp(0) + %[4]s)",
		maxUs, now, micros(extendLease), micros(r+".token + "+maxUs))
}

// extendLease is storage.ExtendLease: the lease asked for, else the
// record's, else the default.
const extendLease = `COALESCE(NULLIF(i.lease_us, 0), NULLIF(r.lease_us, 0), i.default_lease_us)`

// markWaitingSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 replica, $6
// clock offset µs. It adds the replica to the waiters of the record while
// the attempt of token is in progress with its lease live (WaitMarker), at
// most once; it writes nothing, and returns no row, when that attempt has
// ended, so that the waiter decides again at once. A statement that ends
// the attempt afterwards locks the row after this write and returns the
// mark (fencedStatement).
var markWaitingSQL = `
WITH clock AS (
    SELECT now() + CAST($6 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
UPDATE idemreg_records AS r SET
    waiters = CASE WHEN CAST($5 AS TEXT) = ANY(COALESCE(r.waiters, CAST('{}' AS TEXT[]))) THEN r.waiters
                   ELSE array_append(COALESCE(r.waiters, CAST('{}' AS TEXT[])), CAST($5 AS TEXT)) END
FROM clock c
WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
  AND ` + fenced("r", "c.now", "$4") + ` AND ` + notFinal("r") + ` AND ` + leaseLive("r", "c.now") + `
RETURNING r.token`

// lookupSQL: $1 consumer, $2 kind, $3 key, $4 clock offset µs. Expired rows
// stay until swept, so DecideLookup checks expiry on what this returns.
var lookupSQL = `
WITH clock AS (
    SELECT now() + CAST($4 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
SELECT false, c.now, ` + recordColumnsOf("r") + `
FROM idemreg_records r CROSS JOIN clock c
WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3`

// sweepSQL: $1 limit, $2 clock offset µs, $3 the sweep cursor (a lower
// bound on expires_at, inclusive: records sharing the last deleted expiry
// may be left by the LIMIT). The outer expiry predicate repeats the inner
// one so that a record re-claimed after the inner select read it is kept
// (the DELETE re-checks it on the row's latest version at READ COMMITTED;
// at SERIALIZABLE such a race aborts with 40001 and is retried). Expired is
// !Live: expires_at <= now. It returns the latest expiry it deleted, from
// which the store moves its cursor (sweepCursor in store.go): the index
// scan then starts there rather than at the rows deleted before, which
// CockroachDB keeps as MVCC garbage for gc.ttlseconds and scans again.
const sweepSQL = `
WITH clock AS (
    SELECT now() + CAST($2 AS BIGINT) * INTERVAL '1 microsecond' AS now
),
d AS (
    DELETE FROM idemreg_records
    WHERE (consumer, kind, key) IN (
            SELECT consumer, kind, key FROM idemreg_records
            WHERE expires_at >= CAST($3 AS TIMESTAMPTZ)
              AND expires_at <= (SELECT now FROM clock)
            ORDER BY expires_at
            LIMIT $1)
      AND expires_at <= (SELECT now FROM clock)
    RETURNING expires_at
)
SELECT c.now, (SELECT count(*) FROM d), (SELECT max(expires_at) FROM d) FROM clock c`

// oldestExpirySQL: $1 clock offset µs, $2 the sweep cursor, so that it
// does not read through the tombstones below it either (sweepSQL).
const oldestExpirySQL = `
SELECT min(expires_at), now() + CAST($1 AS BIGINT) * INTERVAL '1 microsecond'
FROM idemreg_records
WHERE expires_at >= CAST($2 AS TIMESTAMPTZ)`

// pingSQL is what Ping runs.
const pingSQL = `SELECT 1`

// preparedStatements are prepared on every new connection, so that each
// call is a single Bind/Execute round trip from its first use.
var preparedStatements = []string{
	claimSQL, completeSQL, releaseSQL, extendSQL, parkSQL, lookupSQL, sweepSQL, oldestExpirySQL,
	claimBatchSQL, completeBatchSQL, markWaitingSQL,
}

// recordColumnCount is how many columns recordColumnsOf lists.
var recordColumnCount = strings.Count(recordColumns, ",") + 1

func recordColumnsOf(alias string) string {
	return alias + ".consumer, " + alias + ".kind, " + alias + ".key, " + alias + ".state, " +
		alias + ".fingerprint, " + alias + ".token, " + alias + ".attempt, " + alias + ".holder, " +
		alias + ".created_at, " + alias + ".lease_expires_at, " + alias + ".completed_at, " +
		alias + ".expires_at, " + alias + ".retention_us, " + alias + ".result, " + alias + ".request_id, " + alias + ".lease_us, " + alias + ".park_reason"
}

// recordColumnsNoResultOf is recordColumnsOf with a NULL result, for answers
// that need no result: in-progress records have none, and a written Complete
// knows it.
func recordColumnsNoResultOf(alias string) string {
	return alias + ".consumer, " + alias + ".kind, " + alias + ".key, " + alias + ".state, " +
		alias + ".fingerprint, " + alias + ".token, " + alias + ".attempt, " + alias + ".holder, " +
		alias + ".created_at, " + alias + ".lease_expires_at, " + alias + ".completed_at, " +
		alias + ".expires_at, " + alias + ".retention_us, CAST(NULL AS BYTEA) AS result, " + alias + ".request_id, " + alias + ".lease_us, " + alias + ".park_reason"
}
