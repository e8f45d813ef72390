package postgres

import "fmt"

// The statements below are the whole of the store's SQL. Each RPC runs one
// of them as one implicit transaction: the conditional write and the read of
// the record it did not write travel together, so there is no window between
// a read and a write, and the database's clock is the only clock.
//
// Shape of the writing statements:
//
//	WITH clock AS (SELECT now() + offset AS now),
//	     w     AS (<conditional INSERT or UPDATE> RETURNING <record>)
//	SELECT true,  clock.now, <record> FROM w
//	UNION ALL
//	SELECT false, clock.now, <record> FROM idemreg_records WHERE <pk> AND NOT EXISTS (SELECT 1 FROM w)
//
// (The single-row Claim differs: it reads the row first, see claimSQL.)
//
// The second branch is the pre-image: the row as the statement's snapshot
// saw it, read only when w wrote nothing (PostgreSQL plans NOT EXISTS over an
// uncorrelated CTE as a one-time filter, so the scan is not executed when w
// returned a row). The Go side hands the pre-image to the storage.Decide*
// function, which classifies the answer; if that function says it would have
// written, the row changed after the statement's snapshot and the statement
// runs again (doc.go, "Isolation").
//
// Every predicate that decides a write carries a comment naming the rule in
// storage/rules.go it mirrors. Durations travel as microsecond BIGINTs and
// are turned into intervals by multiplying INTERVAL '1 microsecond', which
// both PostgreSQL and CockroachDB accept; timestamps are microsecond-precise
// on both, so the arithmetic is exact.

// recordColumns is the column list every statement returns, in scan order.
const recordColumns = `consumer, kind, key, state, fingerprint, token, attempt, holder,
    created_at, lease_expires_at, completed_at, expires_at, retention_us, result, request_id, lease_us`

// claimSQL: $1 consumer, $2 kind, $3 key, $4 fingerprint, $5 holder,
// $6 lease µs, $7 retention µs, $8 clock offset µs, $9 request id.
//
// cur is the row as the statement's snapshot sees it. The INSERT proposes
// a fresh record (DecideClaim on an absent key) only when cur does not
// already decide the answer without a write (claimAnswersWithoutWrite: a
// live completed record, a live lease, a fingerprint conflict): a replay or
// an in-progress answer then takes no row lock, gets no transaction id and
// commits without a WAL flush. On a conflict (a row the snapshot did not
// see, or one cur says may be replaced), excluded.created_at is the
// statement's clock reading, and the UPDATE's WHERE is DecideClaim's write
// condition, evaluated on the latest row. The pre-image is cur.
var claimSQL = `
WITH clock AS (
    SELECT now() + CAST($8 AS BIGINT) * INTERVAL '1 microsecond' AS now
),
cur AS (
    SELECT ` + recordColumnsOf("r") + `
    FROM idemreg_records r
    WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
),
w AS (
    INSERT INTO idemreg_records AS r (` + recordColumns + `)
    SELECT CAST($1 AS TEXT), CAST($2 AS SMALLINT), CAST($3 AS TEXT),
        1,                                                  -- StateInProgress
        CAST($4 AS BYTEA),
        CAST(extract(epoch FROM c.now) * 1000000 AS BIGINT),  -- NextToken(0, now): now in µs
        1,                                                  -- Attempt
        CAST($5 AS TEXT),
        c.now,                                              -- CreatedAt
        c.now + CAST($6 AS BIGINT) * INTERVAL '1 microsecond',  -- now + Lease
        NULL,
        c.now + (CAST($6 AS BIGINT) + CAST($7 AS BIGINT)) * INTERVAL '1 microsecond',  -- now + Lease + Retention
        CAST($7 AS BIGINT),
        NULL,
        CAST($9 AS TEXT),
        CAST($6 AS BIGINT)                                  -- Lease
    FROM clock c
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE ` + claimAnswersWithoutWrite("cur", "c.now", "CAST($4 AS BYTEA)") + `)
` + claimOnConflict + `    RETURNING ` + recordColumnsOf("r") + `
)
SELECT true, c.now, ` + recordColumnsOf("w") + `
FROM w CROSS JOIN clock c
UNION ALL
SELECT false, c.now, ` + recordColumnsOf("cur") + `
FROM cur CROSS JOIN clock c
WHERE NOT EXISTS (SELECT 1 FROM w)`

// claimAnswersWithoutWrite is the negation of DecideClaim's write
// condition (claimOnConflict's WHERE) for the record alias r at now with
// the given fingerprint: the record is live, and completed, or its lease
// is live, or its fingerprint conflicts.
func claimAnswersWithoutWrite(r, now, fingerprint string) string {
	return fmt.Sprintf(`%[1]s.expires_at > %[2]s                  -- cur.Live(now)
        AND (%[1]s.state = 2                                  -- completed: a replay
             OR %[1]s.lease_expires_at > %[2]s                -- cur.LeaseLive(now)
             OR (octet_length(%[1]s.fingerprint) > 0          -- FingerprintsConflict
                 AND octet_length(%[3]s) > 0
                 AND %[1]s.fingerprint <> %[3]s))`, r, now, fingerprint)
}

// claimOnConflict is the conflict branch of every Claim statement, the
// single-row one and the batched one: on a conflict, excluded.created_at is
// the statement's clock reading, and the UPDATE's WHERE is DecideClaim's
// write condition.
const claimOnConflict = `    ON CONFLICT (consumer, kind, key) DO UPDATE SET
        -- "r.expires_at <= excluded.created_at" is !cur.Live(now): the record
        -- counts as absent and is replaced by a fresh one; otherwise this is
        -- the takeover, which keeps the record and hands it to the caller.
        state            = excluded.state,
        -- takeover: "if len(rec.Fingerprint) == 0 { rec.Fingerprint = p.Fingerprint }"
        fingerprint      = CASE WHEN r.expires_at <= excluded.created_at OR octet_length(r.fingerprint) = 0
                                THEN excluded.fingerprint ELSE r.fingerprint END,
        -- NextToken(cur.Token, now) = max(prev+1, now in µs), for both cases
        token            = GREATEST(r.token + 1, excluded.token),
        -- takeover: Attempt = cur.Attempt + 1
        attempt          = CASE WHEN r.expires_at <= excluded.created_at THEN 1 ELSE r.attempt + 1 END,
        holder           = excluded.holder,
        request_id       = excluded.request_id,
        lease_us         = excluded.lease_us,
        -- a takeover keeps CreatedAt
        created_at       = CASE WHEN r.expires_at <= excluded.created_at THEN excluded.created_at ELSE r.created_at END,
        lease_expires_at = excluded.lease_expires_at,
        completed_at     = CASE WHEN r.expires_at <= excluded.created_at THEN NULL ELSE r.completed_at END,
        expires_at       = excluded.expires_at,
        retention_us     = excluded.retention_us,
        result           = CASE WHEN r.expires_at <= excluded.created_at THEN NULL ELSE r.result END
    WHERE r.expires_at <= excluded.created_at                   -- !cur.Live(now)
       OR (r.state = 1                                         -- cur.State != StateCompleted
           AND r.lease_expires_at <= excluded.created_at       -- !cur.LeaseLive(now)
           AND NOT (octet_length(r.fingerprint) > 0            -- !FingerprintsConflict(cur.Fingerprint, p.Fingerprint)
                    AND octet_length(excluded.fingerprint) > 0
                    AND r.fingerprint <> excluded.fingerprint))
`

// completeSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 result,
// $6 clock offset µs.
//
// The written branch returns no result: the caller sent it, and keeping the
// answer small keeps CockroachDB able to retry the statement server-side. A
// repeated Complete is answered from the pre-image, which carries the stored
// result (the first result stays).
var completeSQL = fencedUpdateSQL(6, `
        state        = 2,                                                -- StateCompleted
        result       = $5,
        completed_at = c.now,
        expires_at   = c.now + r.retention_us * INTERVAL '1 microsecond'  -- now + cur.Retention
    FROM clock c
    WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
      AND r.expires_at > c.now   -- fenced: cur.Live(now)
      AND r.token = $4           -- fenced: cur.Token == p.Token
      AND r.state = 1            -- cur.State != StateCompleted (a repeat is not written)
`, recordColumnsOf("r"))

// The batched statements below run the Claims or the Completes of many
// callers, on distinct keys, as one statement (see batch.go). Each caller's
// arguments are the same as in the single-row statement, passed as one
// array per argument and unnested in step; every output row carries the
// input's ordinal, so each caller gets the answer for its own key. The write
// conditions are the same text (claimOnConflict) or the same predicates, and
// the pre-image branch reads, for each input key the write skipped, the row
// as the statement's snapshot saw it. A key with no output row is absent.

// claimBatchSQL: $1 consumers, $2 kinds, $3 keys, $4 fingerprints,
// $5 holders, $6 leases µs, $7 retentions µs, $9 request ids (arrays, one
// element per caller), $8 clock offset µs. The keys are distinct: PostgreSQL refuses an
// ON CONFLICT DO UPDATE that affects a row twice.
var claimBatchSQL = `
WITH clock AS (
    SELECT now() + CAST($8 AS BIGINT) * INTERVAL '1 microsecond' AS now
),
i AS (
    SELECT * FROM unnest(CAST($1 AS TEXT[]), CAST($2 AS SMALLINT[]), CAST($3 AS TEXT[]),
                         CAST($4 AS BYTEA[]), CAST($5 AS TEXT[]), CAST($6 AS BIGINT[]), CAST($7 AS BIGINT[]),
                         CAST($9 AS TEXT[]))
        WITH ORDINALITY AS i(consumer, kind, key, fingerprint, holder, lease_us, retention_us, request_id, ord)
),
w AS (
    INSERT INTO idemreg_records AS r (` + recordColumns + `)
    SELECT i.consumer, i.kind, i.key,
        1,                                                  -- StateInProgress
        i.fingerprint,
        CAST(extract(epoch FROM c.now) * 1000000 AS BIGINT),  -- NextToken(0, now): now in µs
        1,                                                  -- Attempt
        i.holder,
        c.now,                                              -- CreatedAt
        c.now + i.lease_us * INTERVAL '1 microsecond',      -- now + Lease
        NULL,
        c.now + (i.lease_us + i.retention_us) * INTERVAL '1 microsecond',  -- now + Lease + Retention
        i.retention_us,
        NULL,
        i.request_id,
        i.lease_us                                          -- Lease
    FROM i CROSS JOIN clock c
    ORDER BY i.ord                                          -- rows are locked in the caller's (sorted) order
` + claimOnConflict + `    RETURNING ` + recordColumnsOf("r") + `
)
` + batchAnswers

// batchAnswers ends both batched statements: for each input (ordinal
// i.ord) the row w wrote, or else the row as the statement's snapshot saw
// it (the pre-image).
var batchAnswers = `
SELECT i.ord, true, c.now, ` + recordColumnsOf("w") + `
FROM w
JOIN i ON i.consumer = w.consumer AND i.kind = w.kind AND i.key = w.key
CROSS JOIN clock c
UNION ALL
SELECT i.ord, false, c.now, ` + recordColumnsOf("r") + `
FROM i
JOIN idemreg_records r ON r.consumer = i.consumer AND r.kind = i.kind AND r.key = i.key
CROSS JOIN clock c
WHERE NOT EXISTS (SELECT 1 FROM w WHERE w.consumer = i.consumer AND w.kind = i.kind AND w.key = i.key)`

// completeBatchSQL: $1 consumers, $2 kinds, $3 keys, $4 tokens, $5 results
// (arrays, one element per caller), $6 clock offset µs. The predicates are
// completeSQL's.
var completeBatchSQL = `
WITH clock AS (
    SELECT now() + CAST($6 AS BIGINT) * INTERVAL '1 microsecond' AS now
),
i AS (
    SELECT * FROM unnest(CAST($1 AS TEXT[]), CAST($2 AS SMALLINT[]), CAST($3 AS TEXT[]),
                         CAST($4 AS BIGINT[]), CAST($5 AS BYTEA[]))
        WITH ORDINALITY AS i(consumer, kind, key, token, result, ord)
),
w AS (
    UPDATE idemreg_records AS r SET
        state        = 2,                                                -- StateCompleted
        result       = i.result,
        completed_at = c.now,
        expires_at   = c.now + r.retention_us * INTERVAL '1 microsecond'  -- now + cur.Retention
    FROM i CROSS JOIN clock c
    WHERE r.consumer = i.consumer AND r.kind = i.kind AND r.key = i.key
      AND r.expires_at > c.now   -- fenced: cur.Live(now)
      AND r.token = i.token      -- fenced: cur.Token == p.Token
      AND r.state = 1            -- cur.State != StateCompleted (a repeat is not written)
    RETURNING ` + recordColumnsNoResultOf("r") + `
)
` + batchAnswers

// releaseSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 clock offset µs.
var releaseSQL = fencedUpdateSQL(5, `
        lease_expires_at = c.now
    FROM clock c
    WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
      AND r.expires_at > c.now         -- fenced: cur.Live(now)
      AND r.token = $4                 -- fenced: cur.Token == p.Token
      AND r.state = 1                  -- cur.State != StateCompleted
      AND r.lease_expires_at > c.now   -- cur.LeaseLive(now): an ended lease is not written
`, recordColumnsNoResultOf("r"))

// extendSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 lease µs (0: the
// record's own), $6 clock offset µs, $7 default lease µs (for a record
// without one).
var extendSQL = fencedUpdateSQL(6, `
        -- LeaseExpiresAt = now + ExtendLease(cur, p)
        lease_expires_at = c.now + `+extendLease+` * INTERVAL '1 microsecond',
        lease_us         = `+extendLease+`,
        -- ExpiresAt = max(cur.ExpiresAt, now + ExtendLease(cur, p) + cur.Retention)
        expires_at       = GREATEST(r.expires_at,
                                    c.now + (`+extendLease+` + r.retention_us) * INTERVAL '1 microsecond')
    FROM clock c
    WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
      AND r.expires_at > c.now   -- fenced: cur.Live(now)
      AND r.token = $4           -- fenced: cur.Token == p.Token
      AND r.state = 1            -- cur.State != StateCompleted
`, recordColumnsNoResultOf("r"))

// extendLease is storage.ExtendLease: the lease asked for, else the
// record's, else the default.
const extendLease = `COALESCE(NULLIF(CAST($5 AS BIGINT), 0), NULLIF(r.lease_us, 0), CAST($7 AS BIGINT))`

// lookupSQL: $1 consumer, $2 kind, $3 key, $4 clock offset µs. Expired rows
// stay until swept, so DecideLookup checks expiry on what this returns.
var lookupSQL = `
WITH clock AS (
    SELECT now() + CAST($4 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
SELECT false, c.now, ` + recordColumnsOf("r") + `
FROM idemreg_records r CROSS JOIN clock c
WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3`

// sweepSQL: $1 limit, $2 clock offset µs. The outer expiry predicate repeats
// the inner one so that a record re-claimed after the inner select read it
// is kept (the DELETE re-checks it on the row's latest version at READ
// COMMITTED; at SERIALIZABLE such a race aborts with 40001 and is retried).
// Expired is !Live: expires_at <= now.
const sweepSQL = `
WITH clock AS (
    SELECT now() + CAST($2 AS BIGINT) * INTERVAL '1 microsecond' AS now
),
d AS (
    DELETE FROM idemreg_records
    WHERE (consumer, kind, key) IN (
            SELECT consumer, kind, key FROM idemreg_records
            WHERE expires_at <= (SELECT now FROM clock)
            ORDER BY expires_at
            LIMIT $1)
      AND expires_at <= (SELECT now FROM clock)
    RETURNING 1
)
SELECT c.now, (SELECT count(*) FROM d) FROM clock c`

// oldestExpirySQL: $1 clock offset µs.
const oldestExpirySQL = `
SELECT min(expires_at), now() + CAST($1 AS BIGINT) * INTERVAL '1 microsecond'
FROM idemreg_records`

// pingSQL is what Ping runs.
const pingSQL = `SELECT 1`

// preparedStatements are prepared on every new connection, so that each
// call is a single Bind/Execute round trip from its first use.
var preparedStatements = []string{
	claimSQL, completeSQL, releaseSQL, extendSQL, lookupSQL, sweepSQL, oldestExpirySQL,
	claimBatchSQL, completeBatchSQL,
}

func recordColumnsOf(alias string) string {
	return alias + ".consumer, " + alias + ".kind, " + alias + ".key, " + alias + ".state, " +
		alias + ".fingerprint, " + alias + ".token, " + alias + ".attempt, " + alias + ".holder, " +
		alias + ".created_at, " + alias + ".lease_expires_at, " + alias + ".completed_at, " +
		alias + ".expires_at, " + alias + ".retention_us, " + alias + ".result, " + alias + ".request_id, " + alias + ".lease_us"
}

// recordColumnsNoResultOf is recordColumnsOf with a NULL result, for answers
// that need no result: in-progress records have none, and a written Complete
// knows it.
func recordColumnsNoResultOf(alias string) string {
	return alias + ".consumer, " + alias + ".kind, " + alias + ".key, " + alias + ".state, " +
		alias + ".fingerprint, " + alias + ".token, " + alias + ".attempt, " + alias + ".holder, " +
		alias + ".created_at, " + alias + ".lease_expires_at, " + alias + ".completed_at, " +
		alias + ".expires_at, " + alias + ".retention_us, CAST(NULL AS BYTEA) AS result, " + alias + ".request_id, " + alias + ".lease_us"
}

// fencedUpdateSQL is the shape of every single-row UPDATE (Complete,
// Release, Extend, Invalidate): the clock (parameter $offset, the clock
// offset in µs), the conditional UPDATE whose SET ... FROM clock c WHERE ...
// clause is set, and the row as the statement's snapshot saw it (columns
// preImage of alias r), read only when the UPDATE wrote nothing. $1, $2, $3
// are the key.
func fencedUpdateSQL(offset int, set, preImage string) string {
	return fmt.Sprintf(`
WITH clock AS (
    SELECT now() + CAST($%d AS BIGINT) * INTERVAL '1 microsecond' AS now
),
w AS (
    UPDATE idemreg_records AS r SET
%s    RETURNING %s
)
SELECT true, c.now, %s
FROM w CROSS JOIN clock c
UNION ALL
SELECT false, c.now, %s
FROM idemreg_records r CROSS JOIN clock c
WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3
  AND NOT EXISTS (SELECT 1 FROM w)`, offset, set, recordColumnsNoResultOf("r"), recordColumnsOf("w"), preImage)
}
