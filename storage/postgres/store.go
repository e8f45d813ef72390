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

	// q coalesces concurrent Claims and Completes (batch.go) when
	// coalesce is set, and sends explicit batches (Batch) always.
	coalesce bool
	q        *queue

	// sweep is where SweepExpired's index scan starts (sweep.go).
	sweep sweepCursor
}

var (
	_ storage.Store        = (*Store)(nil)
	_ storage.Sweeper      = (*Store)(nil)
	_ storage.Batcher      = (*Store)(nil)
	_ storage.MixedBatcher = (*Store)(nil)
	_ storage.WaitMarker   = (*Store)(nil)
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
	s.q = newQueue(o.batchSize, DefaultBatchBytes, o.batchWindow, limit, o.logger, s.runAlone, s.execBatch)
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
// coalesced with concurrent Claims and Completes (see batch.go).
func (s *Store) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	if !s.coalesce {
		return s.claimAlone(ctx, p)
	}
	a := s.q.one(ctx, storage.Op{Claim: &p}, func() storage.OpAnswer {
		res, err := s.claimAlone(ctx, p)
		return storage.OpAnswer{Claim: res, Err: err}
	})
	return a.Claim, a.Err
}

// Complete decides by storage.DecideComplete in one statement, alone or
// coalesced with concurrent Claims and Completes (see batch.go).
func (s *Store) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	if !s.coalesce {
		return s.completeAlone(ctx, p)
	}
	a := s.q.one(ctx, storage.Op{Complete: &p}, func() storage.OpAnswer {
		rec, err := s.completeAlone(ctx, p)
		return storage.OpAnswer{Record: rec, Err: err}
	})
	return a.Record, a.Err
}

// Batch implements storage.MixedBatcher: the items join the store's queue
// (batch.go) together, and travel as one transaction with the calls
// pending beside them, a key's later items in later transactions.
func (s *Store) Batch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	return s.q.many(ctx, ops)
}

// ClaimBatch implements storage.Batcher through Batch.
func (s *Store) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	ops := make([]storage.Op, len(ps))
	for i := range ps {
		ops[i].Claim = &ps[i]
	}
	out := make([]storage.ClaimAnswer, len(ps))
	for i, a := range s.q.many(ctx, ops) {
		out[i] = storage.ClaimAnswer{Result: a.Claim, Err: a.Err}
	}
	return out
}

// CompleteBatch implements storage.Batcher through Batch.
func (s *Store) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	ops := make([]storage.Op, len(ps))
	for i := range ps {
		ops[i].Complete = &ps[i]
	}
	out := make([]storage.CompleteAnswer, len(ps))
	for i, a := range s.q.many(ctx, ops) {
		out[i] = storage.CompleteAnswer{Record: a.Record, Err: a.Err}
	}
	return out
}

// runAlone decides one item with its single-row statement (the queue's
// alone).
func (s *Store) runAlone(ctx context.Context, it *item) {
	if p := it.op.Claim; p != nil {
		it.ans.Claim, it.ans.Err = s.claimAlone(ctx, *p)
		return
	}
	if p := it.op.Complete; p != nil {
		it.ans.Record, it.ans.Err = s.completeAlone(ctx, *p)
		return
	}
	it.ans.Err = fmt.Errorf("postgres batch: an item with neither a Claim nor a Complete")
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

// execBatch runs items (distinct keys, sorted by key) as one transaction:
// the Claims' multi-row statement and the Completes', pipelined in one
// pgx.Batch under one Sync, which both PostgreSQL and CockroachDB run as
// one implicit transaction. No answer is given before the Sync's answer
// (the commit) is read: an error in either statement, or at the commit,
// rolls both back and is returned for the queue to split on. An item whose
// answer is stale (see claimAnswer) is marked to run again alone.
func (s *Store) execBatch(ctx context.Context, items []*item) error {
	var nClaims int
	for _, it := range items {
		if it.op.Claim != nil {
			nClaims++
		}
	}
	claims, completes := make([]*item, 0, nClaims), make([]*item, 0, len(items)-nClaims)
	for _, it := range items {
		if it.op.Claim != nil {
			claims = append(claims, it)
		} else if it.op.Complete != nil {
			completes = append(completes, it)
		}
	}
	var b pgx.Batch
	offset := s.offsetMicros()
	if n := len(claims); n > 0 {
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
		for i, it := range claims {
			p := it.op.Claim
			consumers[i], kinds[i], keys[i] = p.Consumer, int16(p.Kind), p.Key.Key
			fps[i], holders[i], requests[i] = nonNil(p.Fingerprint), p.Holder, p.RequestID
			leases[i], retention[i] = p.Lease.Microseconds(), p.Retention.Microseconds()
			attempts[i] = p.MaxAttempts
		}
		b.Queue(claimBatchSQL, consumers, kinds, keys, fps, holders, leases, retention, offset, requests, attempts)
	}
	if n := len(completes); n > 0 {
		var (
			consumers = make([]string, n)
			kinds     = make([]int16, n)
			keys      = make([]string, n)
			tokens    = make([]int64, n)
			results   = make([][]byte, n)
		)
		for i, it := range completes {
			p := it.op.Complete
			consumers[i], kinds[i], keys[i] = p.Consumer, int16(p.Kind), p.Key.Key
			tokens[i], results[i] = p.Token, p.Result
		}
		b.Queue(completeBatchSQL, consumers, kinds, keys, tokens, results, offset)
	}
	if len(claims) > 0 && len(completes) > 0 {
		s.q.mixed.Add(1)
	}
	br := s.pool.SendBatch(ctx, &b)
	var claimAnswers, completeAnswers []answer
	var err error
	if len(claims) > 0 {
		rows, qerr := br.Query()
		claimAnswers, err = scanBatch(rows, qerr, len(claims))
	}
	if err == nil && len(completes) > 0 {
		rows, qerr := br.Query()
		completeAnswers, err = scanBatch(rows, qerr, len(completes))
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return err
	}
	for i, it := range claims {
		classifyItem(s, it, claimAnswers[i])
	}
	for i, it := range completes {
		classifyItem(s, it, completeAnswers[i])
	}
	return nil
}

// classifyItem sets an item's answer from its row of a batch, or marks it
// to run again alone when the row is stale (see decided).
func classifyItem(s *Store, it *item, a answer) {
	var stale bool
	if p := it.op.Claim; p != nil {
		it.ans.Claim, stale, it.ans.Err = claimAnswer(a, *p)
	} else {
		it.ans.Record, stale, it.ans.Err = completeAnswer(a, *it.op.Complete)
	}
	if stale {
		s.staleReads.Add(1)
		it.ans = storage.OpAnswer{}
		it.again = true
	}
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
	return scanBatch(rows, err, n)
}

// scanBatch reads the rows of a batched statement for n items (queryBatch).
func scanBatch(rows pgx.Rows, err error, n int) ([]answer, error) {
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
