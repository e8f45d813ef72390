package postgres

import (
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
)

// DefaultMaxRetries is how many times a statement is retried after a
// serialization failure or a deadlock before the call fails with
// storage.ErrUnavailable.
const DefaultMaxRetries = 10

// Backoff between retries: exponential from retryBaseDelay, capped at
// retryMaxDelay, with half of each delay drawn at random so that the
// transactions that just conflicted do not collide again in step.
const (
	retryBaseDelay = 2 * time.Millisecond
	retryMaxDelay  = 200 * time.Millisecond
)

// Option configures a Store.
type Option func(*options)

type options struct {
	clockOffset   func() time.Duration
	maxRetries    int
	logger        *slog.Logger
	tracer        pgx.QueryTracer
	meterProvider metric.MeterProvider
	poolConfig    func(*pgxpool.Config)

	batchSize     int
	batchWindow   time.Duration
	batchInFlight int

	sweepCursorLag, sweepRescanEvery time.Duration
}

func defaultOptions() options {
	return options{
		clockOffset: func() time.Duration { return 0 },
		maxRetries:  DefaultMaxRetries,
		logger:      slog.Default(),
		batchSize:   DefaultBatchSize,
		batchWindow: DefaultBatchWindow,

		sweepCursorLag:   DefaultSweepCursorLag,
		sweepRescanEvery: DefaultSweepRescanEvery,
	}
}

// WithClockOffset adds offset() to the database clock in every statement.
// Tests move the store's clock forward with it; the default is zero. The
// offset is applied in microseconds, the database's precision.
func WithClockOffset(offset func() time.Duration) Option {
	return func(o *options) { o.clockOffset = offset }
}

// WithSweepCursor sets how SweepExpired's cursor is bounded (sweep.go):
// it stays at least lag behind the horizon of the batch that moved it
// (default DefaultSweepCursorLag), and a batch starts from the oldest expiry
// again once rescanEvery has passed by database time since the last one
// that did (default DefaultSweepRescanEvery). A rescanEvery of zero or less
// turns the cursor off: every batch scans from the oldest expiry.
func WithSweepCursor(lag, rescanEvery time.Duration) Option {
	return func(o *options) { o.sweepCursorLag, o.sweepRescanEvery = max(lag, 0), rescanEvery }
}

// WithMaxRetries sets how many times a statement is retried after a
// serialization failure or deadlock (default DefaultMaxRetries). Zero means
// one attempt and no retry.
func WithMaxRetries(n int) Option {
	return func(o *options) { o.maxRetries = max(n, 0) }
}

// WithLogger sets the logger for retries and internal inconsistencies
// (default slog.Default()). Stored results are never logged.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// WithTracer sets a pgx query tracer on every connection, for tracing or
// metrics of the caller's own, beside the store's (WithMeterProvider).
func WithTracer(t pgx.QueryTracer) Option {
	return func(o *options) { o.tracer = t }
}

// WithPoolConfig lets the caller adjust the pool configuration (pool sizes,
// connection lifetimes, the ping of idle connections). Two settings are the
// store's and are applied after fn: SERIALIZABLE as the default isolation,
// and the preparation of the store's statements, which runs after any
// AfterConnect that fn sets.
func WithPoolConfig(fn func(*pgxpool.Config)) Option {
	return func(o *options) { o.poolConfig = fn }
}

// WithBatching sets how concurrent Claims and Completes are coalesced into
// one transaction of multi-row statements (see the package documentation):
// a pending batch of size items is sent without waiting for a slot
// (default DefaultBatchSize; 1 or less turns the coalescing of unary calls
// off, so every call is its own statement, while explicit batches still
// travel together); inFlight statement slots (default
// DefaultBatchInFlight), the transactions that run before calls start to
// queue, for both kinds together; and a queued call waits at most window
// (default DefaultBatchWindow) for a slot before its batch is sent anyway.
// Zero window or inFlight keeps the default.
func WithBatching(size int, window time.Duration, inFlight int) Option {
	return func(o *options) {
		o.batchSize = size
		if window > 0 {
			o.batchWindow = window
		}
		o.batchInFlight = inFlight
	}
}
