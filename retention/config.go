package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
)

// Defaults of Config, documented in docs/retention.md.
const (
	// DefaultBatchSize is the most records one batch deletes: small enough
	// that a batch is a short transaction holding few locks, large enough
	// that a backlog of millions goes in minutes.
	DefaultBatchSize = 1000
	// DefaultMinBatchSize is the floor the batch size shrinks to after
	// timeouts.
	DefaultMinBatchSize = 10
	// DefaultBatchTimeout bounds each batch.
	DefaultBatchTimeout = 5 * time.Second
	// DefaultPause is the mean pause between two batches, which leaves the
	// store to live traffic; each pause is drawn from [Pause/2, 3·Pause/2].
	DefaultPause = 50 * time.Millisecond
	// DefaultMaxErrors is how many batches in a row may fail before a pass
	// gives up.
	DefaultMaxErrors = 5
	// DefaultErrorBackoff is the pause after the first failed batch; it
	// doubles with each further failure in a row, up to maxErrorBackoff.
	DefaultErrorBackoff = time.Second
	// DefaultInterval is the time between the passes of Run.
	DefaultInterval = time.Minute
	// DefaultProgressInterval is how often a pass logs its progress.
	DefaultProgressInterval = 10 * time.Second
)

const maxErrorBackoff = 30 * time.Second

// Config configures a Sweeper. Zero fields take the documented defaults.
type Config struct {
	// BatchSize is the most records one batch deletes (DefaultBatchSize).
	BatchSize int
	// MinBatchSize is the floor that timeouts shrink the batch size to
	// (DefaultMinBatchSize, or BatchSize when that is smaller).
	MinBatchSize int
	// BatchTimeout bounds each batch (DefaultBatchTimeout). A batch that
	// times out is rolled back, counted as an error, and the batch size is
	// halved; batches that finish in under a quarter of the timeout double
	// it again, up to BatchSize.
	BatchTimeout time.Duration
	// Pause is the mean pause between batches (DefaultPause), jittered by
	// ±50%; negative means no pause.
	Pause time.Duration
	// MaxDuration bounds a pass: no batch starts after it (one that is
	// running may finish, within BatchTimeout). Zero means no bound.
	MaxDuration time.Duration
	// MaxErrors is how many batches in a row may fail before the pass
	// gives up (DefaultMaxErrors).
	MaxErrors int
	// ErrorBackoff is the pause after a failed batch (DefaultErrorBackoff),
	// doubled for each further failure in a row, at most 30s, jittered.
	ErrorBackoff time.Duration
	// Interval is the time between two passes of Run (DefaultInterval),
	// jittered by ±10% so that replicas drift apart.
	Interval time.Duration
	// ProgressInterval is how often a pass logs its progress
	// (DefaultProgressInterval).
	ProgressInterval time.Duration

	// Logger receives the progress logs; nil discards them.
	Logger *slog.Logger
	// MeterProvider makes the sweeper's instruments; nil means
	// otel.GetMeterProvider().
	MeterProvider metric.MeterProvider

	// Now is the local clock, which measures durations, rates and
	// MaxDuration (default time.Now). The horizon of a delete is always the
	// store's clock.
	Now func() time.Time
	// Sleep waits for d or until ctx ends, returning ctx's error then
	// (default: a timer). Tests replace it to run without waiting.
	Sleep func(ctx context.Context, d time.Duration) error
	// Rand returns a number in [0, 1) for the jitter (default
	// math/rand/v2's Float64).
	Rand func() float64
}

func (c *Config) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.MinBatchSize == 0 {
		c.MinBatchSize = min(DefaultMinBatchSize, c.BatchSize)
	}
	if c.BatchTimeout == 0 {
		c.BatchTimeout = DefaultBatchTimeout
	}
	if c.Pause == 0 {
		c.Pause = DefaultPause
	}
	if c.MaxErrors == 0 {
		c.MaxErrors = DefaultMaxErrors
	}
	if c.ErrorBackoff == 0 {
		c.ErrorBackoff = DefaultErrorBackoff
	}
	if c.Interval == 0 {
		c.Interval = DefaultInterval
	}
	if c.ProgressInterval == 0 {
		c.ProgressInterval = DefaultProgressInterval
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Sleep == nil {
		c.Sleep = sleep
	}
	if c.Rand == nil {
		c.Rand = rand.Float64
	}
}

// Validate reports settings that cannot work, after defaults are applied.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.BatchSize < 1 {
		errs = append(errs, fmt.Errorf("batch size must be positive, got %d", c.BatchSize))
	}
	if c.MinBatchSize < 1 || c.MinBatchSize > c.BatchSize {
		errs = append(errs, fmt.Errorf("min batch size must be between 1 and the batch size %d, got %d", c.BatchSize, c.MinBatchSize))
	}
	if c.BatchTimeout < 0 {
		errs = append(errs, fmt.Errorf("batch timeout must be positive, got %v", c.BatchTimeout))
	}
	if c.MaxDuration < 0 {
		errs = append(errs, fmt.Errorf("max duration must not be negative (zero means no bound), got %v", c.MaxDuration))
	}
	if c.MaxErrors < 1 {
		errs = append(errs, fmt.Errorf("max errors must be positive, got %d", c.MaxErrors))
	}
	if c.ErrorBackoff < 0 {
		errs = append(errs, fmt.Errorf("error backoff must be positive, got %v", c.ErrorBackoff))
	}
	if c.Interval < 0 {
		errs = append(errs, fmt.Errorf("interval must be positive, got %v", c.Interval))
	}
	if c.ProgressInterval < 0 {
		errs = append(errs, fmt.Errorf("progress interval must be positive, got %v", c.ProgressInterval))
	}
	return errors.Join(errs...)
}

// jitter returns d scaled by a random factor in [1-f, 1+f).
func (c *Config) jitter(d time.Duration, f float64) time.Duration {
	if d <= 0 {
		return 0
	}
	return time.Duration(float64(d) * (1 - f + 2*f*c.Rand()))
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
