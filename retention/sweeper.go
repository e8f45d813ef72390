// Package retention owns the sweeper: the one loop that deletes expired
// records from a store implementing storage.Sweeper, used both by
// `idemreg sweep` (one pass, Once) and by `idemreg serve --sweep-interval`
// (a pass every interval, Run).
//
// A pass deletes in bounded batches, each its own short call to the store
// with a timeout, with a jittered pause between them, until a batch comes
// back short (nothing expired is left), MaxDuration passes, or the context
// ends. The horizon of each batch is the store's clock, and the store
// re-checks expiry in its delete, so a record extended or claimed again
// meanwhile is kept: the sweeper decides nothing about records itself.
// After a timeout the batch shrinks. Any number of sweepers may run against
// one store at once; each record is deleted once.
//
// Progress is logged (deleted so far, rate, oldest expiry left) and
// measured through OpenTelemetry instruments (see metrics.go).
package retention

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// ErrMaxDuration is returned by Once when MaxDuration ran out while expired
// records may be left.
var ErrMaxDuration = errors.New("retention: max duration reached before the sweep finished")

// Stop says how a pass ended.
type Stop string

// How a pass ends.
const (
	// StopFinished: a batch came back short; nothing expired was left.
	StopFinished Stop = "finished"
	// StopMaxDuration: MaxDuration ran out after a full batch.
	StopMaxDuration Stop = "max_duration"
	// StopCanceled: the context ended.
	StopCanceled Stop = "canceled"
	// StopFailed: MaxErrors batches in a row failed.
	StopFailed Stop = "failed"
)

// Result describes a pass.
type Result struct {
	// Stop says how the pass ended.
	Stop Stop
	// Deleted is how many records the pass deleted; Batches how many
	// batches it ran, Errors how many of them failed.
	Deleted        int64
	Batches        int
	Errors         int
	Duration       time.Duration
	FinalBatchSize int
	// Oldest is the earliest expiry of the records left after the pass,
	// StoreNow the store's clock when it was read. HasOldest is false when
	// the store holds no record, or the read failed.
	Oldest, StoreNow time.Time
	HasOldest        bool
}

// Lag is how long the oldest record left has been expired by the store's
// clock; zero when none is.
func (r Result) Lag() time.Duration {
	if !r.HasOldest || r.Oldest.After(r.StoreNow) {
		return 0
	}
	return r.StoreNow.Sub(r.Oldest)
}

// Rate is the deletion rate of the pass in records per second.
func (r Result) Rate() float64 { return rate(r.Deleted, r.Duration) }

func rate(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// Sweeper deletes expired records. It is safe for concurrent use, though one
// Sweeper runs one pass at a time per caller; several Sweepers (or
// processes) may sweep one store at once.
type Sweeper struct {
	store storage.Sweeper
	cfg   Config
	in    *instruments
}

// New returns a sweeper of store.
func New(store storage.Sweeper, cfg Config) (*Sweeper, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("retention: %w", err)
	}
	cfg.setDefaults()
	in, err := newInstruments(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	return &Sweeper{store: store, cfg: cfg, in: in}, nil
}

// Config returns the sweeper's configuration with its defaults applied.
func (s *Sweeper) Config() Config { return s.cfg }

// Run sweeps a pass every Interval (jittered) until ctx ends, starting at
// once. A pass that stopped at MaxDuration is followed by the next one
// after a pause rather than an interval. A failed pass is logged and the
// next one is tried after the interval. Run returns when ctx ends.
func (s *Sweeper) Run(ctx context.Context) {
	for {
		res, _ := s.Once(ctx)
		if ctx.Err() != nil {
			return
		}
		wait := s.cfg.jitter(s.cfg.Interval, 0.1)
		if res.Stop == StopMaxDuration {
			wait = s.cfg.jitter(s.cfg.Pause, 0.5)
		}
		if s.cfg.Sleep(ctx, wait) != nil {
			return
		}
	}
}

// pass is the state of one pass.
type pass struct {
	s            *Sweeper
	res          Result
	start        time.Time
	deadline     time.Time // zero when MaxDuration is
	lastProgress time.Time
	batch        int
}

// Once runs one pass. It returns nil when the pass finished (a short batch
// after which the store's oldest record was not expired, or three short
// batches in a row); ErrMaxDuration when
// MaxDuration ran out first; an error matching ctx.Err() when ctx ended; or
// the last store error, wrapped, when MaxErrors batches in a row failed.
// The Result describes the pass in every case.
func (s *Sweeper) Once(ctx context.Context) (Result, error) {
	p := &pass{s: s, start: s.cfg.Now(), batch: s.cfg.BatchSize}
	p.lastProgress = p.start
	if s.cfg.MaxDuration > 0 {
		p.deadline = p.start.Add(s.cfg.MaxDuration)
	}
	s.in.batchSize.Record(ctx, int64(p.batch))
	p.readOldest(ctx)
	s.cfg.Logger.DebugContext(ctx, "sweep started", p.progressFields()...)

	err := p.loop(ctx)
	p.res.Duration = s.cfg.Now().Sub(p.start)
	p.res.FinalBatchSize = p.batch
	if p.res.Stop != StopCanceled {
		p.readOldest(ctx)
	}
	// Recorded without ctx's cancellation, so a cancelled pass is counted.
	s.in.passDuration.Record(context.WithoutCancel(ctx), p.res.Duration.Seconds(), outcomeAttr(string(p.res.Stop)))

	fields := append([]any{"stop", p.res.Stop, "batches", p.res.Batches, "errors", p.res.Errors,
		"duration", p.res.Duration, "rate_per_s", round(p.res.Rate())}, p.progressFields()...)
	switch {
	case err != nil && p.res.Stop != StopCanceled:
		s.cfg.Logger.WarnContext(ctx, "sweep stopped before it finished", append(fields, "error", err)...)
	case p.res.Deleted > 0 || p.res.Stop != StopFinished:
		s.cfg.Logger.InfoContext(ctx, "sweep finished", fields...)
	default:
		s.cfg.Logger.DebugContext(ctx, "sweep finished", fields...)
	}
	return p.res, err
}

func (p *pass) loop(ctx context.Context) error {
	cfg := &p.s.cfg
	failures, shortBatches := 0, 0
	var lastErr error
	for {
		if err := ctx.Err(); err != nil {
			p.res.Stop = StopCanceled
			return fmt.Errorf("retention: sweep cancelled: %w", err)
		}
		if !p.deadline.IsZero() && !cfg.Now().Before(p.deadline) {
			p.res.Stop = StopMaxDuration
			return ErrMaxDuration
		}

		deleted, elapsed, err := p.runBatch(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			p.res.Stop = StopCanceled
			return fmt.Errorf("retention: sweep cancelled: %w", ctx.Err())
		case err != nil:
			failures++
			p.res.Errors++
			lastErr = err
			if errors.Is(err, context.DeadlineExceeded) {
				shrunk := max(p.batch/2, cfg.MinBatchSize)
				cfg.Logger.WarnContext(ctx, "sweep batch timed out; shrinking the batch",
					"batch_size", p.batch, "new_batch_size", shrunk, "timeout", cfg.BatchTimeout, "failures_in_a_row", failures)
				p.setBatch(ctx, shrunk)
			} else {
				cfg.Logger.WarnContext(ctx, "sweep batch failed", "batch_size", p.batch, "error", err, "failures_in_a_row", failures)
			}
			if failures >= cfg.MaxErrors {
				p.res.Stop = StopFailed
				return fmt.Errorf("retention: %d sweep batches in a row failed, the last with: %w", failures, lastErr)
			}
			backoff := min(cfg.ErrorBackoff<<(failures-1), maxErrorBackoff)
			if err := p.pause(ctx, cfg.jitter(backoff, 0.5)); err != nil {
				return err
			}
			continue
		}

		failures = 0
		if deleted < p.batch {
			// Under concurrent sweepers a short batch is no proof that
			// nothing expired is left: two that pick the same oldest rows
			// wait for each other, and the second deletes none of them. So
			// a short batch ends the pass only when the store's oldest
			// record is not expired, or after maxShortBatches short
			// batches in a row (records that stay expired and undeletable
			// must not keep a pass going).
			shortBatches++
			if shortBatches < maxShortBatches && p.expiredLeft(ctx) {
				if err := p.pause(ctx, cfg.jitter(cfg.Pause, 0.5)); err != nil {
					return err
				}
				continue
			}
			p.res.Stop = StopFinished
			return nil
		}
		shortBatches = 0
		if elapsed < cfg.BatchTimeout/4 && p.batch < cfg.BatchSize {
			p.setBatch(ctx, min(p.batch*2, cfg.BatchSize))
		}
		if now := cfg.Now(); now.Sub(p.lastProgress) >= cfg.ProgressInterval {
			p.lastProgress = now
			p.readOldest(ctx)
			cfg.Logger.InfoContext(ctx, "sweep progress", append([]any{
				"batches", p.res.Batches, "elapsed", now.Sub(p.start),
				"rate_per_s", round(rate(p.res.Deleted, now.Sub(p.start))), "batch_size", p.batch,
			}, p.progressFields()...)...)
		}
		if err := p.pause(ctx, cfg.jitter(cfg.Pause, 0.5)); err != nil {
			return err
		}
	}
}

// runBatch runs one batch with its own timeout.
func (p *pass) runBatch(ctx context.Context) (deleted int, elapsed time.Duration, err error) {
	cfg := &p.s.cfg
	bctx, cancel := context.WithTimeout(ctx, cfg.BatchTimeout)
	defer cancel()
	t0 := cfg.Now()
	res, err := p.s.store.SweepExpired(bctx, p.batch)
	elapsed = cfg.Now().Sub(t0)
	p.res.Batches++
	if err != nil {
		if ctx.Err() == nil {
			p.s.in.batchFailed(ctx, errors.Is(err, context.DeadlineExceeded), elapsed.Seconds())
		}
		return 0, elapsed, err
	}
	p.res.Deleted += int64(res.Deleted)
	p.s.in.batchDone(ctx, res.Deleted, elapsed.Seconds())
	return res.Deleted, elapsed, nil
}

// pause waits d, but not past the deadline, and reports a cancellation.
func (p *pass) pause(ctx context.Context, d time.Duration) error {
	if !p.deadline.IsZero() {
		d = min(d, p.deadline.Sub(p.s.cfg.Now()))
	}
	if err := p.s.cfg.Sleep(ctx, d); err != nil && ctx.Err() != nil {
		p.res.Stop = StopCanceled
		return fmt.Errorf("retention: sweep cancelled: %w", ctx.Err())
	}
	return nil
}

func (p *pass) setBatch(ctx context.Context, n int) {
	p.batch = n
	p.s.in.batchSize.Record(ctx, int64(n))
}

// readOldest reads the oldest expiry left and records the lag. A failure
// is logged and counted, never fatal: the batches decide.
// maxShortBatches is how many short batches in a row end a pass even
// though expired records seem left.
const maxShortBatches = 3

// expiredLeft reads the store's oldest expiry and reports whether a record
// expired at the store's clock is left.
func (p *pass) expiredLeft(ctx context.Context) bool {
	p.readOldest(ctx)
	return p.res.HasOldest && !p.res.Oldest.After(p.res.StoreNow)
}

func (p *pass) readOldest(ctx context.Context) {
	cfg := &p.s.cfg
	bctx, cancel := context.WithTimeout(ctx, cfg.BatchTimeout)
	defer cancel()
	oldest, now, ok, err := p.s.store.OldestExpiry(bctx)
	if err != nil {
		p.res.HasOldest = false
		if ctx.Err() == nil {
			cfg.Logger.WarnContext(ctx, "sweep: reading the oldest expiry failed", "error", err)
			p.s.in.errors.Add(ctx, 1, attrsOldestExpiryError(err))
		}
		return
	}
	p.res.Oldest, p.res.StoreNow, p.res.HasOldest = oldest, now, ok
	p.s.in.lag.Record(ctx, p.res.Lag().Seconds())
}

// progressFields are the log fields saying what is done and what is left.
func (p *pass) progressFields() []any {
	fields := []any{"deleted", p.res.Deleted}
	if p.res.HasOldest {
		fields = append(fields, "oldest_expiry", p.res.Oldest, "lag", p.res.Lag())
	} else {
		fields = append(fields, "oldest_expiry", nil)
	}
	return fields
}

func round(x float64) float64 { return float64(int64(x*10+0.5)) / 10 }
