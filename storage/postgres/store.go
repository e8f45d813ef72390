package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/storage"
)

// Store is the SQL storage backend. It is safe for concurrent use, and any
// number of Stores in any number of processes may share one database.
type Store struct {
	pool *pgxpool.Pool
	// poolMetrics is the registration of the pool's instruments.
	poolMetrics metric.Registration
	clockOffset func() time.Duration
	maxRetries  int
	logger      *slog.Logger

	// staleReads counts statements run again because the pre-image they
	// read was older than the row their conditional write saw (see
	// isolation in doc.go).
	staleReads atomic.Int64

	// claims and completes coalesce concurrent calls (batch.go) when
	// coalesce is set, and send explicit batches (ClaimBatch) always.
	coalesce  bool
	coalescer *coalescer
	claims    *batcher[storage.ClaimParams, storage.ClaimResult]
	completes *batcher[storage.CompleteParams, storage.Record]

	// sweep is where SweepExpired's index scan starts (sweep.go).
	sweep sweepCursor
}

var (
	_ storage.Store      = (*Store)(nil)
	_ storage.Sweeper    = (*Store)(nil)
	_ storage.Batcher    = (*Store)(nil)
	_ storage.WaitMarker = (*Store)(nil)
)

// Open returns a Store on the database at databaseURL, whose schema Migrate
// has created. Connections are made on demand, so Open succeeds while the
// database is down; Ping tells whether it can serve.
//
// Connections to PostgreSQL run at READ COMMITTED and connections to
// CockroachDB at SERIALIZABLE, whatever the role's default: doc.go
// ("Isolation") says why each statement is correct at both.
func Open(ctx context.Context, databaseURL string, opts ...Option) (*Store, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		// pgx quotes the string in its parse errors, redacted only as
		// far as its patterns go.
		return nil, fmt.Errorf("postgres: parse database URL: %w", withoutSecrets(err, databaseURL))
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemreg"
	}
	if cfg.ConnConfig.Tracer, err = o.queryTracer(); err != nil {
		return nil, fmt.Errorf("postgres: metrics: %w", err)
	}
	if o.poolConfig != nil {
		o.poolConfig(cfg)
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	afterConnect := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		if afterConnect != nil {
			if err := afterConnect(ctx, conn); err != nil {
				return err
			}
		}
		if err := setSession(ctx, conn); err != nil {
			return err
		}
		return prepare(ctx, conn)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: open pool: %w", withoutSecrets(err, databaseURL))
	}
	s := &Store{pool: pool, clockOffset: o.clockOffset, maxRetries: o.maxRetries, logger: o.logger,
		sweep: sweepCursor{lag: o.sweepCursorLag, rescanEvery: o.sweepRescanEvery}}
	limit := o.batchInFlight
	if limit <= 0 {
		limit = DefaultBatchInFlight
	}
	s.coalesce = o.batchSize > 1
	s.coalescer = &coalescer{maxSize: max(o.batchSize, 1), maxBytes: DefaultBatchBytes, window: o.batchWindow, limit: limit}
	s.claims = newBatcher(s.coalescer, s, "claim",
		func(p storage.ClaimParams) storage.Key { return p.Key }, claimBytes, s.claimAlone, s.claimBatch)
	s.completes = newBatcher(s.coalescer, s, "complete",
		func(p storage.CompleteParams) storage.Key { return p.Key }, completeBytes, s.completeAlone, s.completeBatch)
	if s.poolMetrics, err = s.instrumentPool(o.meterProvider); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: metrics: %w", err)
	}
	return s, nil
}

// setSession sets a PostgreSQL session up for the store's statements; a
// CockroachDB session (it reports crdb_version when it connects) is left as
// it was opened (SERIALIZABLE, its own plan cache).
//
//   - READ COMMITTED: each statement decides on the latest committed rows
//     (doc.go, "Isolation").
//   - Generic plans, always: every statement is a lookup by key or a scan
//     of an index range, whose plan does not depend on the parameters'
//     values. Left to choose, PostgreSQL compares the generic plan's cost
//     with that of the first five custom plans, and a batched statement of
//     two or three keys, whose custom plans know the arrays are short,
//     kept a custom plan: it was planned again on every execution, about
//     650 µs of the database's CPU per statement, four times what executing
//     it cost (docs/benchmarks.md, "Small batches").
func setSession(ctx context.Context, conn *pgx.Conn) error {
	if conn.PgConn().ParameterStatus("crdb_version") != "" {
		return nil
	}
	if _, err := conn.Exec(ctx, "SET default_transaction_isolation = 'read committed'"); err != nil {
		return fmt.Errorf("postgres: set isolation: %w", err)
	}
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = 'force_generic_plan'"); err != nil {
		return fmt.Errorf("postgres: set plan cache mode: %w", err)
	}
	return nil
}

// prepare prepares the store's statements on a new connection, keyed by
// their text, so that pgx executes them with a single Bind/Execute round
// trip from their first use instead of preparing them on the request path.
func prepare(ctx context.Context, conn *pgx.Conn) error {
	for _, sql := range preparedStatements {
		if _, err := conn.Prepare(ctx, sql, sql); err != nil {
			return fmt.Errorf("postgres: prepare statements (has Migrate run?): %w", err)
		}
	}
	return nil
}

// Close closes the pool's connections.
func (s *Store) Close() error {
	_ = s.poolMetrics.Unregister()
	s.pool.Close()
	return nil
}

// Ping runs a trivial statement. Errors: storage.ErrUnavailable, or the
// context's error.
func (s *Store) Ping(ctx context.Context) error {
	return s.run(ctx, "ping", func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, pingSQL)
		return err
	})
}

// Claim decides by storage.DecideClaim in one statement, alone or
// coalesced with concurrent Claims (see batch.go).
func (s *Store) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	if s.coalesce {
		return s.claims.do(ctx, p)
	}
	return s.claimAlone(ctx, p)
}

// Bytes a call adds to a batched statement: its variable-length values,
// and for each array element its 4-byte length and 8 bytes per fixed
// value.
func claimBytes(p storage.ClaimParams) int {
	return len(p.Consumer) + len(p.Key.Key) + len(p.Fingerprint) + len(p.Holder) + len(p.RequestID) + 9*4 + 4*8
}

func completeBytes(p storage.CompleteParams) int {
	return len(p.Consumer) + len(p.Key.Key) + len(p.Result) + 5*4 + 2*8
}

// claimAlone runs one Claim with the single-row statement.
func (s *Store) claimAlone(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	return decided(ctx, s, "claim", func(a answer) (storage.ClaimResult, bool, error) { return claimAnswer(a, p) },
		claimSQL, p.Consumer, int16(p.Kind), p.Key.Key, nonNil(p.Fingerprint), p.Holder,
		p.Lease.Microseconds(), p.Retention.Microseconds(), s.offsetMicros(), p.RequestID, p.MaxAttempts)
}

// claimAnswer classifies a Claim statement's row. It is stale when the
// statement wrote nothing and its pre-image does not explain why: no row
// (the insert met a row its snapshot did not see), or a row the rules
// would have written.
func claimAnswer(a answer, p storage.ClaimParams) (res storage.ClaimResult, stale bool, err error) {
	if a.written {
		if a.rec.State == storage.StateParked { // the takeover parked it
			return storage.ClaimResult{Outcome: storage.OutcomeParked, Record: a.rec}, false, nil
		}
		return storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: a.rec}, false, nil
	}
	if !a.found {
		return storage.ClaimResult{}, true, nil
	}
	return storage.DecideClaim(a.now, &a.rec, p)
}

// claimBatch runs the Claims of calls as one statement. A call whose answer
// is stale (see claimAnswer) runs again alone.
func (s *Store) claimBatch(ctx context.Context, calls []*call[storage.ClaimParams, storage.ClaimResult]) error {
	n := len(calls)
	var (
		consumers = make([]string, n)
		kinds     = make([]int16, n)
		keys      = make([]string, n)
		fps       = make([][]byte, n)
		holders   = make([]string, n)
		leases    = make([]int64, n)
		retention = make([]int64, n)
		requests  = make([]string, n)
		attempts  = make([]int64, n)
	)
	for i, cl := range calls {
		p := &cl.p
		consumers[i], kinds[i], keys[i] = p.Consumer, int16(p.Kind), p.Key.Key
		fps[i], holders[i], requests[i] = nonNil(p.Fingerprint), p.Holder, p.RequestID
		leases[i], retention[i] = p.Lease.Microseconds(), p.Retention.Microseconds()
		attempts[i] = p.MaxAttempts
	}
	answers, err := s.queryBatch(ctx, claimBatchSQL, n,
		consumers, kinds, keys, fps, holders, leases, retention, s.offsetMicros(), requests, attempts)
	if err != nil {
		return err
	}
	deliver(s, calls, answers, claimAnswer)
	return nil
}

// Complete decides by storage.DecideComplete in one statement, alone or
// coalesced with concurrent Completes (see batch.go).
func (s *Store) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	if s.coalesce {
		return s.completes.do(ctx, p)
	}
	return s.completeAlone(ctx, p)
}

// completeAlone runs one Complete with the single-row statement.
func (s *Store) completeAlone(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	return decided(ctx, s, "complete", func(a answer) (storage.Record, bool, error) { return completeAnswer(a, p) },
		completeSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Result, s.offsetMicros())
}

// completeAnswer classifies a Complete statement's row (or its absence);
// stale as in claimAnswer.
func completeAnswer(a answer, p storage.CompleteParams) (rec storage.Record, stale bool, err error) {
	if a.written {
		a.rec.Result = p.Result // not sent back: see completeSQL
		return a.rec, false, nil
	}
	return storage.DecideComplete(a.now, a.current(), p)
}

// completeBatch runs the Completes of calls as one statement.
func (s *Store) completeBatch(ctx context.Context, calls []*call[storage.CompleteParams, storage.Record]) error {
	n := len(calls)
	var (
		consumers = make([]string, n)
		kinds     = make([]int16, n)
		keys      = make([]string, n)
		tokens    = make([]int64, n)
		results   = make([][]byte, n)
	)
	for i, cl := range calls {
		p := &cl.p
		consumers[i], kinds[i], keys[i] = p.Consumer, int16(p.Kind), p.Key.Key
		tokens[i], results[i] = p.Token, p.Result
	}
	answers, err := s.queryBatch(ctx, completeBatchSQL, n, consumers, kinds, keys, tokens, results, s.offsetMicros())
	if err != nil {
		return err
	}
	deliver(s, calls, answers, completeAnswer)
	return nil
}

// ClaimBatch implements storage.Batcher: the items go out as one batched
// statement per round of distinct keys (batch.go, many).
func (s *Store) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	rs, errs := s.claims.many(ctx, ps)
	out := make([]storage.ClaimAnswer, len(ps))
	for i := range out {
		out[i] = storage.ClaimAnswer{Result: rs[i], Err: errs[i]}
	}
	return out
}

// CompleteBatch implements storage.Batcher like ClaimBatch.
func (s *Store) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	rs, errs := s.completes.many(ctx, ps)
	out := make([]storage.CompleteAnswer, len(ps))
	for i := range out {
		out[i] = storage.CompleteAnswer{Record: rs[i], Err: errs[i]}
	}
	return out
}

// Release decides by storage.DecideRelease in one statement.
func (s *Store) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	return s.fencedUpdate(ctx, "release", func(a answer) (storage.Record, bool, error) {
		return storage.DecideRelease(a.now, a.current(), p)
	}, releaseSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros())
}

// Extend decides by storage.DecideExtend in one statement.
func (s *Store) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	return s.fencedUpdate(ctx, "extend", func(a answer) (storage.Record, bool, error) {
		return storage.DecideExtend(a.now, a.current(), p)
	}, extendSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Lease.Microseconds(), s.offsetMicros(), p.DefaultLease.Microseconds(),
		p.MaxLeaseTotal.Microseconds())
}

// Park decides by storage.DecidePark in one statement.
func (s *Store) Park(ctx context.Context, p storage.ParkParams) (storage.Record, error) {
	return s.fencedUpdate(ctx, "park", func(a answer) (storage.Record, bool, error) {
		return storage.DecidePark(a.now, a.current(), p)
	}, parkSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Reason, s.offsetMicros())
}

// fencedUpdate runs one of the fencedStatement statements: the written row
// is the answer, and a declined write is answered by decide on the
// pre-image.
func (s *Store) fencedUpdate(ctx context.Context, op string, decide func(answer) (storage.Record, bool, error), sql string, args ...any) (storage.Record, error) {
	return decided(ctx, s, op, func(a answer) (storage.Record, bool, error) {
		if a.written {
			return a.rec, false, nil
		}
		return decide(a)
	}, sql, args...)
}

// MarkWaiting implements storage.WaitMarker in one statement.
func (s *Store) MarkWaiting(ctx context.Context, p storage.MarkWaitingParams) (bool, error) {
	var marked bool
	err := s.run(ctx, "mark waiting", func(ctx context.Context) error {
		var token int64
		err := s.pool.QueryRow(ctx, markWaitingSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Replica, s.offsetMicros()).Scan(&token)
		if errors.Is(err, pgx.ErrNoRows) {
			marked = false
			return nil
		}
		marked = err == nil
		return err
	})
	return marked, err
}

// Lookup decides by storage.DecideLookup on one read.
func (s *Store) Lookup(ctx context.Context, k storage.Key) (storage.Record, error) {
	var a answer
	err := s.run(ctx, "lookup", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, lookupSQL, k.Consumer, int16(k.Kind), k.Key, s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.Record{}, err
	}
	return storage.DecideLookup(a.now, a.current())
}

// SweepExpired deletes at most limit expired records, oldest expiry first,
// in one statement. Its scan starts at the store's sweep cursor rather than
// at the oldest expiry (sweepCursor in sweep.go says why that is safe, and
// how it is bounded).
func (s *Store) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	if limit < 0 {
		return storage.SweepResult{}, fmt.Errorf("postgres sweep: negative limit %d", limit)
	}
	var (
		res     storage.SweepResult
		deleted int64
		latest  *time.Time
	)
	from := s.sweep.from()
	err := s.run(ctx, "sweep", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, sweepSQL, int64(limit), s.offsetMicros(), from).Scan(&res.Now, &deleted, &latest)
	})
	if err != nil {
		return storage.SweepResult{}, err
	}
	res.Deleted = int(deleted)
	res.Now = res.Now.UTC()
	if limit > 0 {
		var last time.Time
		if latest != nil {
			last = latest.UTC()
		}
		s.sweep.moved(from, res.Now, last, res.Deleted < limit)
	}
	return res, nil
}

// OldestExpiry reports the earliest expires_at and the database's clock.
// It reads from the sweep cursor, as SweepExpired does: below it there are
// only tombstones, and the rare record written under it (sweep.go), which
// the next rescan deletes and this does not report meanwhile.
func (s *Store) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	var first *time.Time
	from := s.sweep.from()
	err = s.run(ctx, "oldest expiry", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, oldestExpirySQL, s.offsetMicros(), from).Scan(&first, &now)
	})
	if err != nil {
		return time.Time{}, time.Time{}, false, err
	}
	if first == nil {
		return time.Time{}, now.UTC(), false, nil
	}
	return first.UTC(), now.UTC(), true, nil
}

func (s *Store) offsetMicros() int64 { return s.clockOffset().Microseconds() }

// decided runs a single-row statement and hands its row to classify,
// which returns the call's answer, or stale when the statement declined a
// write that the rules would have made on its pre-image. That happens when
// the row changed after the statement's snapshot (READ COMMITTED lets the
// conditional write see the newer version; doc.go, "Isolation"): the
// statement runs again, and then sees that version. Staleness that
// outlasts the retries would mean the SQL and the rules disagree: it is
// logged as an error and the call fails with storage.ErrUnavailable. The
// error classify returns is the call's answer (ErrLeaseLost, say), not a
// failure of the statement.
func decided[R any](ctx context.Context, s *Store, op string, classify func(answer) (R, bool, error), sql string, args ...any) (R, error) {
	var (
		a      answer
		res    R
		resErr error
	)
	err := s.run(ctx, op, func(ctx context.Context) error {
		answers, err := s.queryBatch(ctx, sql, 1, args...)
		if err != nil {
			return err
		}
		a = answers[0]
		var stale bool
		if res, stale, resErr = classify(a); stale {
			s.staleReads.Add(1)
			return errStale
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, errStale) {
			s.logger.ErrorContext(ctx, "postgres: statement declined a write the rules require",
				"op", op, "found", a.found, "consumer", a.rec.Consumer, "kind", a.rec.Kind, "key", a.rec.Key,
				"state", a.rec.State, "token", a.rec.Token, "now", a.now,
				"lease_expires_at", a.rec.LeaseExpiresAt, "expires_at", a.rec.ExpiresAt)
		}
		var zero R
		return zero, err
	}
	return res, resErr
}

// deliver hands each call of a batch the answer classify gives for its
// row; a call whose answer is stale (see decided) runs again alone.
func deliver[P, R any](s *Store, calls []*call[P, R], answers []answer, classify func(answer, P) (R, bool, error)) {
	for i, cl := range calls {
		r, stale, err := classify(answers[i], cl.p)
		if stale {
			s.staleReads.Add(1)
			cl.done <- outcome[R]{alone: true}
			continue
		}
		cl.done <- outcome[R]{r: r, err: err}
	}
}

// answer is one row of a record statement: whether the statement wrote it,
// the statement's clock reading, and the record (written, or the pre-image).
type answer struct {
	found   bool
	written bool
	now     time.Time
	rec     storage.Record
}

// current is the pre-image for a Decide function: nil when absent.
func (a *answer) current() *storage.Record {
	if !a.found {
		return nil
	}
	return &a.rec
}

func (s *Store) queryRecord(ctx context.Context, sql string, args ...any) (answer, error) {
	a, err := scanAnswer(s.pool.QueryRow(ctx, sql, args...))
	if errors.Is(err, pgx.ErrNoRows) {
		return answer{}, nil
	}
	return a, err
}

// queryBatch runs a batched statement for n calls and returns their
// answers by position; a call whose key has no row gets an answer with found
// false. It returns nothing but the error when the statement failed,
// including at its commit.
func (s *Store) queryBatch(ctx context.Context, sql string, n int, args ...any) ([]answer, error) {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	answers := make([]answer, n)
	// The statements that can end an attempt return the waiters column
	// last (fencedStatement).
	fields := rows.FieldDescriptions()
	waiters := len(fields) > 0 && fields[len(fields)-1].Name == "waiters"
	for rows.Next() {
		var ord int64
		a, err := scanRecord(rows, []any{&ord}, false, waiters)
		if err != nil {
			return nil, err
		}
		if ord < 1 || ord > int64(n) {
			return nil, fmt.Errorf("batch row with ordinal %d of %d", ord, n)
		}
		answers[ord-1] = a
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return answers, nil
}

// scanAnswer scans one row of a record statement, after the columns in
// lead (the ordinal of a batched statement).
func scanAnswer(row pgx.Row, lead ...any) (answer, error) {
	return scanRecord(row, lead, false, false)
}

// scanRecord is scanAnswer of a row that ends with the history column
// when withHistory is set (Inspect, List), or with the waiters column when
// withWaiters is (fencedStatement): those are kept only in a written row's
// answer, the waiters of the attempt it ended.
func scanRecord(row pgx.Row, lead []any, withHistory, withWaiters bool) (answer, error) {
	var (
		a           answer
		r           = &a.rec
		kind, state int16
		completedAt *time.Time
		retentionUS int64
		leaseUS     int64
		history     []byte
	)
	dest := append(lead, &a.written, &a.now,
		&r.Consumer, &kind, &r.Key.Key, &state, &r.Fingerprint, &r.Token, &r.Attempt, &r.Holder,
		&r.CreatedAt, &r.LeaseExpiresAt, &completedAt, &r.ExpiresAt, &retentionUS, &r.Result, &r.RequestID, &leaseUS, &r.ParkReason)
	if withHistory {
		dest = append(dest, &history)
	}
	var waiters []string
	if withWaiters {
		dest = append(dest, &waiters)
	}
	if err := row.Scan(dest...); err != nil {
		return answer{}, err
	}
	if a.written {
		r.Waiters = waiters
	}
	if withHistory {
		var err error
		if r.History, err = decodeHistory(history); err != nil {
			return answer{}, err
		}
	}
	a.found = true
	a.now = a.now.UTC()
	r.Kind = storage.Kind(kind)
	r.State = storage.State(state)
	r.CreatedAt = r.CreatedAt.UTC()
	r.LeaseExpiresAt = r.LeaseExpiresAt.UTC()
	if completedAt != nil {
		r.CompletedAt = completedAt.UTC()
	}
	r.ExpiresAt = r.ExpiresAt.UTC()
	r.Retention = time.Duration(retentionUS) * time.Microsecond
	r.Lease = time.Duration(leaseUS) * time.Microsecond
	return a, nil
}

// nonNil turns a missing fingerprint into the empty one the NOT NULL column
// stores (pgx sends a nil slice as NULL).
func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}
