package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Admin = (*Store)(nil)

// Admin statements are rare, so they are not prepared on every connection.

// invalidateSQL: $1 consumer, $2 kind, $3 key, $4 expected token (0: any),
// $5 clock offset µs, $6 reason. It keeps the row (see
// storage.DecideInvalidate): the row's token is what keeps the key's next
// token above every earlier one.
var invalidateSQL = fencedStatement(5,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"},
		param{6, "reason", "TEXT"}),
	`        state            = 1,                      -- StateInProgress
        -- a parked record is resolved: Attempt starts again from 0
        attempt          = CASE WHEN `+parked("r")+` THEN 0 ELSE r.attempt END,
        park_reason      = '',
        fingerprint      = CAST('' AS BYTEA),      -- Fingerprint = nil
        token            = `+nextToken("r.token", "c.now")+`,
        lease_us         = 0,                      -- nobody holds the new token
        lease_expires_at = c.now,                  -- the lease ends now
        completed_at     = NULL,
        result           = NULL,
        -- ExpiresAt = max(cur.ExpiresAt, now + cur.Retention)
        expires_at       = GREATEST(r.expires_at, c.now + `+micros("r.retention_us")+`),
        history          = `+appendHistory("r.history", ended("r", "c.now", storage.AttemptInvalidated, "i.reason")),
	live("r", "c.now")+" AND (i.token = 0 OR r.token = i.token)", // p.Token == 0 || cur.Token == p.Token
	recordColumnsNoResultOf("r"))

// resolveSQL: $1 consumer, $2 kind, $3 key, $4 token, $5 complete, $6
// result (NULL to release), $7 reason, $8 clock offset µs. Both branches of
// storage.DecideResolve in one statement: every column the two set
// differently is a CASE on i.complete. The WHERE is DecideResolve's write
// condition (fenced, and a completed record only with a result); a written
// Complete does not send its result back, as completeSQL does not.
var resolveSQL = fencedStatement(8,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"},
		param{5, "complete", "BOOLEAN"}, param{6, "result", "BYTEA"}, param{7, "reason", "TEXT"}),
	`        -- Complete: StateCompleted with Result; release: StateInProgress
        state            = CASE WHEN i.complete THEN 2 ELSE 1 END,
        result           = CASE WHEN i.complete THEN i.result ELSE r.result END,
        completed_at     = CASE WHEN i.complete THEN c.now ELSE r.completed_at END,
        -- release: Attempt = 0, so max_attempts counts afresh
        attempt          = CASE WHEN i.complete THEN r.attempt ELSE 0 END,
        park_reason      = '',
        token            = `+nextToken("r.token", "c.now")+`,
        lease_us         = 0,  -- nobody holds the new token
        -- Complete: min(cur.LeaseExpiresAt, now); release: now
        lease_expires_at = CASE WHEN i.complete THEN LEAST(r.lease_expires_at, c.now) ELSE c.now END,
        -- Complete: now + cur.Retention; release: max(cur.ExpiresAt, now + cur.Retention)
        expires_at       = CASE WHEN i.complete THEN c.now + `+micros("r.retention_us")+`
                                ELSE GREATEST(r.expires_at, c.now + `+micros("r.retention_us")+`) END,
        history          = `+appendHistory("r.history",
		"CASE WHEN i.complete THEN "+ended("r", "c.now", storage.AttemptResolvedCompleted, "i.reason")+
			" ELSE "+ended("r", "c.now", storage.AttemptResolvedReleased, "i.reason")+" END"),
	fenced("r", "c.now", "i.token")+" AND (i.complete OR NOT "+completed("r")+")",
	recordColumnsNoResultOf("r"))

// inspectSQL: $1 consumer, $2 kind, $3 key, $4 clock offset µs. lookupSQL
// with the history, which only the admin reads.
var inspectSQL = `
WITH clock AS (
    SELECT now() + CAST($4 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
SELECT false, c.now, ` + recordColumnsOf("r") + `, r.history
FROM idemreg_records r CROSS JOIN clock c
WHERE r.consumer = $1 AND r.kind = $2 AND r.key = $3`

// Inspect returns the stored row, expired or not, with its history, and
// the database's clock.
func (s *Store) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	var a answer
	err := s.run(ctx, "inspect", func(ctx context.Context) error {
		var err error
		a, err = scanRecord(s.pool.QueryRow(ctx, inspectSQL, k.Consumer, int16(k.Kind), k.Key, s.offsetMicros()), nil, true, false)
		if errors.Is(err, pgx.ErrNoRows) {
			a, err = answer{}, nil
		}
		return err
	})
	if err != nil {
		return storage.InspectResult{}, err
	}
	if !a.found {
		return storage.InspectResult{}, storage.ErrNotFound
	}
	return storage.InspectResult{Record: a.rec, Now: a.now}, nil
}

// Invalidate decides by storage.DecideInvalidate in one statement.
func (s *Store) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	rec, err := s.fencedUpdate(ctx, "invalidate", func(a answer) (storage.Record, bool, error) {
		return storage.DecideInvalidate(a.now, a.current(), p)
	}, invalidateSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros(), p.Reason)
	if err != nil {
		return storage.Record{}, err
	}
	// Only a written row succeeds (DecideInvalidate always writes a live,
	// fenced record); its fingerprint is stored as empty, as the rules
	// leave it nil.
	rec.Fingerprint = nil
	return rec, nil
}

// Resolve decides by storage.DecideResolve in one statement.
func (s *Store) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	var result []byte
	if p.Complete {
		result = p.Result
	}
	rec, err := s.fencedUpdate(ctx, "resolve", func(a answer) (storage.Record, bool, error) {
		return storage.DecideResolve(a.now, a.current(), p)
	}, resolveSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Complete, result, p.Reason, s.offsetMicros())
	if err != nil {
		return storage.Record{}, err
	}
	// Only a written row succeeds (DecideResolve writes whenever it does
	// not refuse); a resolved Complete's result is not sent back.
	if p.Complete {
		rec.Result = p.Result
	}
	return rec, nil
}

// historyEntry is one element of the history column, as ended (queries.go)
// writes it: storage.Attempt under short keys, since every row carries up
// to storage.MaxHistory of them, and EndedAt in microseconds since the
// epoch, as tokens are.
type historyEntry struct {
	Attempt    int64              `json:"a"`
	Token      int64              `json:"t"`
	Holder     string             `json:"h"`
	EndedAt    int64              `json:"e"`
	End        storage.AttemptEnd `json:"n"`
	ParkReason string             `json:"p"`
	Note       string             `json:"o"`
}

// decodeHistory reads the history column; an empty history is nil, as the
// rules leave a fresh record's.
func decodeHistory(b []byte) ([]storage.Attempt, error) {
	var entries []historyEntry
	if err := json.Unmarshal(b, &entries); err != nil {
		return nil, fmt.Errorf("postgres: decode history: %w", err)
	}
	if len(entries) == 0 {
		return nil, nil
	}
	out := make([]storage.Attempt, len(entries))
	for i, e := range entries {
		out[i] = storage.Attempt{Attempt: e.Attempt, Token: e.Token, Holder: e.Holder,
			EndedAt: time.UnixMicro(e.EndedAt).UTC(), End: e.End, ParkReason: e.ParkReason, Note: e.Note}
	}
	return out, nil
}

// listScope is the part of the primary key a List reads.
type listScope int

const (
	scopeExact listScope = iota // one consumer: consumer = $1
	scopeFrom                   // a prefix with no end (prefixEnd): consumer >= $1
	scopeRange                  // a prefix and its end: $1 <= consumer < $11
)

// listVariant picks one of the List statements: its scope, and whether it
// lists parked records only, from their partial index.
type listVariant struct {
	scope  listScope
	parked bool
}

// listSQL holds a statement per variant rather than one with parameters for
// the choices: a prepared statement's generic plan must see the index it
// may use in the text itself, the parked index's predicate above all.
var listSQL = func() map[listVariant]string {
	out := map[listVariant]string{}
	for _, scope := range []listScope{scopeExact, scopeFrom, scopeRange} {
		for _, parked := range []bool{false, true} {
			out[listVariant{scope, parked}] = listStatement(listVariant{scope, parked})
		}
	}
	return out
}()

// listStatement is one page of Admin.List: $1 consumer (or prefix), $2 $3
// $4 the key the page starts after, $5 the most index entries to read
// (ListScanLimit), $6 the most records to return, $7 state (0: any), $8
// min attempt, $9 older than µs (0: any), $10 clock offset µs, and for
// scopeRange $11 the prefix's end.
//
// scanned is the window: at most $5 entries of the index, in key order,
// after $2-$4, within the scope; the parked variant states the parked
// index's predicate so that the window is read from that index. page is
// the records of the window that match the filters (listMatches), at most
// $6. The first row of the answer (part 0) carries the clock, how many
// entries the window read and the last of them (NULL when it read none),
// from which List tells where the next page starts; the page's records
// follow in key order (part 1), without their result.
func listStatement(v listVariant) string {
	scope := "r.consumer = CAST($1 AS TEXT)"
	switch v.scope {
	case scopeFrom:
		scope = "r.consumer >= CAST($1 AS TEXT)"
	case scopeRange:
		scope = "r.consumer >= CAST($1 AS TEXT) AND r.consumer < CAST($11 AS TEXT)"
	}
	if v.parked {
		scope += " AND " + parked("r")
	}
	return `
WITH ` + clock(10) + `,
scanned AS (
    SELECT ` + recordColumnsNoResultOf("r") + `, r.history
    FROM idemreg_records r
    WHERE ` + scope + `
      AND (r.consumer, r.kind, r.key) > (CAST($2 AS TEXT), CAST($3 AS SMALLINT), CAST($4 AS TEXT))
    ORDER BY r.consumer, r.kind, r.key
    LIMIT CAST($5 AS BIGINT)
),
page AS (
    SELECT s.* FROM scanned s CROSS JOIN clock c
    WHERE ` + listMatches("s", "c.now") + `
    ORDER BY s.consumer, s.kind, s.key
    LIMIT CAST($6 AS BIGINT)
)
SELECT 0 AS part, CAST(n.n AS BIGINT), false, c.now, ` + recordColumnsNoResultOf("l") + `, l.history
FROM clock c
CROSS JOIN (SELECT count(*) AS n FROM scanned) n
LEFT JOIN (SELECT * FROM scanned ORDER BY consumer DESC, kind DESC, key DESC LIMIT 1) l ON true
UNION ALL
SELECT 1, 0, false, c.now, ` + recordColumnsNoResultOf("p") + `, p.history
FROM page p CROSS JOIN clock c
ORDER BY 1, 5, 6, 7`
}

// listMatches is storage.ListParams.Matches for the record alias r at now,
// with List's filters: $7 state, $8 min attempt, $9 older than µs, each
// unset at 0.
func listMatches(r, now string) string {
	return live(r, now) + `
      AND (CAST($7 AS SMALLINT) = 0 OR ` + r + `.state = CAST($7 AS SMALLINT))
      AND (CAST($8 AS BIGINT) <= 0 OR ` + r + `.attempt >= CAST($8 AS BIGINT))
      AND (CAST($9 AS BIGINT) <= 0 OR ` + r + `.created_at <= ` + now + ` - ` + micros("CAST($9 AS BIGINT)") + `)`
}

// prefixEnd is the least string above every string that starts with p in
// code point order, the order of CockroachDB's strings and of PostgreSQL's
// under a C or C.UTF-8 collation (doc.go, "Listing"): p with its last code
// point incremented, after dropping any trailing U+10FFFF. ok is false
// when there is none (p empty, or all U+10FFFF): the range is unbounded.
func prefixEnd(p string) (end string, ok bool) {
	r := []rune(p)
	for i := len(r) - 1; i >= 0; i-- {
		if r[i] == utf8.MaxRune {
			continue
		}
		next := r[i] + 1
		if next >= 0xD800 && next <= 0xDFFF { // surrogates are not code points of a string
			next = 0xE000
		}
		return string(r[:i]) + string(next), true
	}
	return "", false
}

// List reads one window of index entries in key order and returns the
// records in it that match p, in one statement (listStatement).
func (s *Store) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	if p.Limit <= 0 {
		return storage.ListResult{}, fmt.Errorf("postgres list: limit %d is not positive", p.Limit)
	}
	scan := storage.ListScanLimit(p.Limit)
	// The first page starts after a key below every key of the scope:
	// kinds are never negative.
	afterConsumer, afterKind, afterKey := p.Consumer, int16(-1), ""
	if p.After != nil {
		afterConsumer, afterKind, afterKey = p.After.Consumer, int16(p.After.Kind), p.After.Key
	}
	v := listVariant{scope: scopeExact, parked: p.State == storage.StateParked}
	args := []any{p.Consumer, afterConsumer, afterKind, afterKey, int64(scan), int64(p.Limit),
		int16(p.State), p.MinAttempt, p.OlderThan.Microseconds(), s.offsetMicros()}
	if p.Prefix {
		v.scope = scopeFrom
		if end, ok := prefixEnd(p.Consumer); ok {
			v.scope = scopeRange
			args = append(args, end)
		}
	}

	var res storage.ListResult
	err := s.run(ctx, "list", func(ctx context.Context) error {
		res = storage.ListResult{}
		rows, err := s.pool.Query(ctx, listSQL[v], args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		var (
			part, scanned         int64
			lastConsumer, lastKey *string
			lastKind              *int16
		)
		if !rows.Next() {
			if err := rows.Err(); err != nil {
				return err
			}
			return errors.New("postgres list: no summary row")
		}
		// The rest of the last entry's record and its history are skipped.
		dest := append([]any{&part, &scanned, nil, &res.Now, &lastConsumer, &lastKind, &lastKey}, make([]any, recordColumnCount-3+1)...)
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		if part != 0 {
			return fmt.Errorf("postgres list: first row is part %d, not the summary", part)
		}
		res.Now = res.Now.UTC()
		for rows.Next() {
			var n int64
			a, err := scanRecord(rows, []any{&part, &n}, true, false)
			if err != nil {
				return err
			}
			res.Records = append(res.Records, a.rec)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		switch {
		case len(res.Records) >= p.Limit:
			k := res.Records[len(res.Records)-1].Key
			res.Next = &k
		case scanned >= int64(scan) && lastConsumer != nil:
			res.Next = &storage.Key{Consumer: *lastConsumer, Kind: storage.Kind(*lastKind), Key: *lastKey}
		}
		return nil
	})
	if err != nil {
		return storage.ListResult{}, err
	}
	return res, nil
}

// countParkedSQL: $1 prefix, $2 clock offset µs, and when bounded $3 the
// prefix's end (prefixEnd). It reads the parked index (its predicate is
// stated) over the prefix's range only.
func countParkedStatement(bounded bool) string {
	scope := "r.consumer >= CAST($1 AS TEXT)"
	if bounded {
		scope += " AND r.consumer < CAST($3 AS TEXT)"
	}
	return `
WITH ` + clock(2) + `
SELECT r.consumer, CAST(count(*) AS BIGINT)
FROM idemreg_records r CROSS JOIN clock c
WHERE ` + parked("r") + ` AND ` + scope + ` AND ` + live("r", "c.now") + `
GROUP BY r.consumer`
}

var (
	countParkedFromSQL  = countParkedStatement(false)
	countParkedRangeSQL = countParkedStatement(true)
)

// CountParked counts the live parked records of the consumers under prefix
// in one statement.
func (s *Store) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	sql, args := countParkedFromSQL, []any{prefix, s.offsetMicros()}
	if end, ok := prefixEnd(prefix); ok {
		sql, args = countParkedRangeSQL, append(args, end)
	}
	out := map[string]int64{}
	err := s.run(ctx, "count parked", func(ctx context.Context) error {
		clear(out)
		rows, err := s.pool.Query(ctx, sql, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				consumer string
				n        int64
			)
			if err := rows.Scan(&consumer, &n); err != nil {
				return err
			}
			out[consumer] = n
		}
		return rows.Err()
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
