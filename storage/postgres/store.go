package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemreg/idemreg/storage"
)

// Store is the SQL storage backend. It is safe for concurrent use, and any
// number of Stores in any number of processes may share one database.
type Store struct {
	pool        *pgxpool.Pool
	clockOffset func() time.Duration
	maxRetries  int
	logger      *slog.Logger
}

var (
	_ storage.Store   = (*Store)(nil)
	_ storage.Sweeper = (*Store)(nil)
)

// Open returns a Store on the database at databaseURL, whose schema Migrate
// has created. Connections are made on demand, so Open succeeds while the
// database is down; Ping tells whether it can serve.
//
// Every connection runs at SERIALIZABLE (PostgreSQL's default is READ
// COMMITTED; CockroachDB's is SERIALIZABLE already): the statements rely on
// it to read the same row version they declined to write.
func Open(ctx context.Context, databaseURL string, opts ...Option) (*Store, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		// pgx redacts the password in its parse errors.
		return nil, fmt.Errorf("postgres: parse database URL: %w", err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemreg"
	}
	if o.tracer != nil {
		cfg.ConnConfig.Tracer = o.tracer
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
		return prepare(ctx, conn)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: open pool: %w", err)
	}
	return &Store{pool: pool, clockOffset: o.clockOffset, maxRetries: o.maxRetries, logger: o.logger}, nil
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

// Claim decides by storage.DecideClaim in one statement.
func (s *Store) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	var a answer
	err := s.run(ctx, "claim", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, claimSQL,
			p.Consumer, int16(p.Kind), p.Key.Key, nonNil(p.Fingerprint), p.Holder,
			p.Lease.Microseconds(), p.Retention.Microseconds(), s.offsetMicros())
		if err == nil && !a.found {
			return errNoRow
		}
		return err
	})
	if err != nil {
		return storage.ClaimResult{}, err
	}
	if a.written {
		return storage.ClaimResult{Outcome: storage.OutcomeAcquired, Record: a.rec}, nil
	}
	res, write, err := storage.DecideClaim(a.now, &a.rec, p)
	if write {
		return storage.ClaimResult{}, s.disagree(ctx, "claim", a)
	}
	return res, err
}

// Complete decides by storage.DecideComplete in one statement.
func (s *Store) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	var a answer
	err := s.run(ctx, "complete", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, completeSQL,
			p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Result, s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.Record{}, err
	}
	if a.written {
		a.rec.Result = p.Result // not sent back: see completeSQL
		return a.rec, nil
	}
	rec, write, err := storage.DecideComplete(a.now, a.current(), p)
	if write {
		return storage.Record{}, s.disagree(ctx, "complete", a)
	}
	return rec, err
}

// Release decides by storage.DecideRelease in one statement.
func (s *Store) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	var a answer
	err := s.run(ctx, "release", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, releaseSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.Record{}, err
	}
	if a.written {
		return a.rec, nil
	}
	rec, write, err := storage.DecideRelease(a.now, a.current(), p)
	if write {
		return storage.Record{}, s.disagree(ctx, "release", a)
	}
	return rec, err
}

// Extend decides by storage.DecideExtend in one statement.
func (s *Store) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	var a answer
	err := s.run(ctx, "extend", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, extendSQL,
			p.Consumer, int16(p.Kind), p.Key.Key, p.Token, p.Lease.Microseconds(), s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.Record{}, err
	}
	if a.written {
		return a.rec, nil
	}
	rec, write, err := storage.DecideExtend(a.now, a.current(), p)
	if write {
		return storage.Record{}, s.disagree(ctx, "extend", a)
	}
	return rec, err
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
// in one statement.
func (s *Store) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	if limit < 0 {
		return storage.SweepResult{}, fmt.Errorf("postgres sweep: negative limit %d", limit)
	}
	var (
		res     storage.SweepResult
		deleted int64
	)
	err := s.run(ctx, "sweep", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, sweepSQL, int64(limit), s.offsetMicros()).Scan(&res.Now, &deleted)
	})
	if err != nil {
		return storage.SweepResult{}, err
	}
	res.Deleted = int(deleted)
	res.Now = res.Now.UTC()
	return res, nil
}

// OldestExpiry reports the earliest expires_at and the database's clock.
func (s *Store) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	var first *time.Time
	err = s.run(ctx, "oldest expiry", func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, oldestExpirySQL, s.offsetMicros()).Scan(&first, &now)
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

// disagree reports a declined write that the rules would have made.
func (s *Store) disagree(ctx context.Context, op string, a answer) error {
	s.logger.ErrorContext(ctx, "postgres: statement declined a write the rules require",
		"op", op, "consumer", a.rec.Consumer, "kind", a.rec.Kind, "key", a.rec.Key,
		"state", a.rec.State, "token", a.rec.Token, "now", a.now,
		"lease_expires_at", a.rec.LeaseExpiresAt, "expires_at", a.rec.ExpiresAt)
	return fmt.Errorf("postgres %s: %w", op, errRulesDisagree)
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
	var (
		a           answer
		r           = &a.rec
		kind, state int16
		completedAt *time.Time
		retentionUS int64
	)
	err := s.pool.QueryRow(ctx, sql, args...).Scan(
		&a.written, &a.now,
		&r.Consumer, &kind, &r.Key.Key, &state, &r.Fingerprint, &r.Token, &r.Attempt, &r.Holder,
		&r.CreatedAt, &r.LeaseExpiresAt, &completedAt, &r.ExpiresAt, &retentionUS, &r.Result)
	if errors.Is(err, pgx.ErrNoRows) {
		return answer{}, nil
	}
	if err != nil {
		return answer{}, err
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
