package retention_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/storage"
)

// fakeClock is the sweeper's local clock and the fake store's: Sleep moves
// it instead of waiting, so a pass runs without a single real pause.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	sleeps []time.Duration
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sleeps = append(c.sleeps, d)
	c.now = c.now.Add(max(d, 0))
	return nil
}

func (c *fakeClock) Sleeps() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.sleeps...)
}

// fakeStore holds a number of expired records, each expired 90s by its
// clock, and one live record. Each SweepExpired costs cost on the clock;
// fail, when set, may fail a call (numbered from 1).
type fakeStore struct {
	clock *fakeClock
	cost  time.Duration
	fail  func(ctx context.Context, call, limit int) error

	mu      sync.Mutex
	expired int
	calls   int
	limits  []int
}

const expiredFor = 90 * time.Second

func (s *fakeStore) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	s.mu.Lock()
	s.calls++
	call := s.calls
	s.limits = append(s.limits, limit)
	s.mu.Unlock()
	s.clock.Advance(s.cost)
	if s.fail != nil {
		if err := s.fail(ctx, call, limit); err != nil {
			return storage.SweepResult{}, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(limit, s.expired)
	s.expired -= n
	return storage.SweepResult{Deleted: n, Now: s.clock.Now()}, nil
}

func (s *fakeStore) OldestExpiry(context.Context) (oldest, now time.Time, ok bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now = s.clock.Now()
	if s.expired > 0 {
		return now.Add(-expiredFor), now, true, nil
	}
	return now.Add(time.Hour), now, true, nil // the live record
}

func (s *fakeStore) Add(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expired += n
}

func (s *fakeStore) Limits() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.limits...)
}

// half makes every jitter factor exactly 1, so pauses are exact.
func half() float64 { return 0.5 }

func newSweeper(t *testing.T, store storage.Sweeper, clock *fakeClock, cfg retention.Config) *retention.Sweeper {
	t.Helper()
	cfg.Now, cfg.Sleep = clock.Now, clock.Sleep
	if cfg.Rand == nil {
		cfg.Rand = half
	}
	sw, err := retention.New(store, cfg)
	require.NoError(t, err)
	return sw
}

func TestOnceRunsBatchesUntilAShortOne(t *testing.T) {
	for _, tc := range []struct {
		name    string
		expired int
		limits  []int
	}{
		{"remainder", 2500, []int{1000, 1000, 1000}},
		{"exact multiple", 2000, []int{1000, 1000, 1000}},
		{"nothing expired", 0, []int{1000}},
		{"less than a batch", 999, []int{1000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := newFakeClock()
			store := &fakeStore{clock: clock, expired: tc.expired, cost: 10 * time.Millisecond}
			sw := newSweeper(t, store, clock, retention.Config{})

			res, err := sw.Once(t.Context())
			require.NoError(t, err)
			require.Equal(t, retention.StopFinished, res.Stop)
			require.EqualValues(t, tc.expired, res.Deleted)
			require.Equal(t, len(tc.limits), res.Batches)
			require.Zero(t, res.Errors)
			require.Equal(t, tc.limits, store.Limits())
			require.Len(t, clock.Sleeps(), len(tc.limits)-1, "a pause between batches, none after the last")
			for _, d := range clock.Sleeps() {
				require.Equal(t, retention.DefaultPause, d)
			}
			require.True(t, res.HasOldest)
			require.Zero(t, res.Lag(), "only the live record is left")
			require.Equal(t, time.Duration(len(tc.limits))*(10*time.Millisecond)+time.Duration(len(tc.limits)-1)*retention.DefaultPause, res.Duration)
		})
	}
}

func TestPauseJitter(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 100}
	var draws []float64
	rnd := func() float64 { // 0, 0.1, ..., 0.9
		x := float64(len(draws)%10) / 10
		draws = append(draws, x)
		return x
	}
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 10, Pause: 100 * time.Millisecond, Rand: rnd})
	_, err := sw.Once(t.Context())
	require.NoError(t, err)
	sleeps := clock.Sleeps()
	require.Len(t, sleeps, 10)
	for i, d := range sleeps {
		require.Equal(t, 50*time.Millisecond+time.Duration(i)*10*time.Millisecond, d, "pause %d: uniform in [Pause/2, 3·Pause/2)", i)
	}
}

func TestOnceShrinksAfterATimeoutAndGrowsBack(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 5000, cost: 10 * time.Millisecond}
	store.fail = func(_ context.Context, call, _ int) error {
		if call == 2 || call == 3 {
			return fmt.Errorf("postgres sweep: %w", context.DeadlineExceeded)
		}
		return nil
	}
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 1000, MinBatchSize: 300, BatchTimeout: time.Second})
	res, err := sw.Once(t.Context())
	require.NoError(t, err)
	require.Equal(t, retention.StopFinished, res.Stop)
	require.EqualValues(t, 5000, res.Deleted)
	require.Equal(t, 2, res.Errors)
	// 1000 ok; 1000 timeout → 500; 500 timeout → 300 (the floor);
	// 300 ok → 600; 600 ok → 1000 (the cap); 1000 × 3; the last 100.
	require.Equal(t, []int{1000, 1000, 500, 300, 600, 1000, 1000, 1000, 1000}, store.Limits())
	require.Equal(t, 1000, res.FinalBatchSize)
	sleeps := clock.Sleeps()
	require.Equal(t, []time.Duration{retention.DefaultPause, time.Second, 2 * time.Second}, sleeps[:3],
		"after a failure the pause is the error backoff, doubled for each failure in a row")
}

// TestOnceBatchTimeout lets a batch really run into its timeout: the store
// blocks until the batch's context ends.
func TestOnceBatchTimeout(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 150}
	store.fail = func(ctx context.Context, call, _ int) error {
		if call == 1 {
			<-ctx.Done()
			return fmt.Errorf("postgres sweep: %w", ctx.Err())
		}
		return nil
	}
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, BatchTimeout: 20 * time.Millisecond})
	res, err := sw.Once(t.Context())
	require.NoError(t, err)
	require.Equal(t, []int{100, 50, 100, 100}, store.Limits())
	require.Equal(t, 1, res.Errors)
	require.EqualValues(t, 150, res.Deleted)
}

func TestOnceGivesUpAfterMaxErrorsInARow(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 5000}
	down := fmt.Errorf("%w: postgres sweep: connection refused", storage.ErrUnavailable)
	store.fail = func(_ context.Context, call, _ int) error {
		if call == 2 {
			return nil
		}
		return down
	}
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, MaxErrors: 3})
	res, err := sw.Once(t.Context())
	require.ErrorIs(t, err, storage.ErrUnavailable)
	require.ErrorContains(t, err, "3 sweep batches in a row failed")
	require.Equal(t, retention.StopFailed, res.Stop)
	require.Equal(t, 4, res.Errors, "1 failure, a success, then 3 failures in a row")
	require.EqualValues(t, 100, res.Deleted, "what was deleted before the failure counts")
	require.Equal(t, []time.Duration{time.Second, retention.DefaultPause, time.Second, 2 * time.Second}, clock.Sleeps())
}

func TestOnceMaxDuration(t *testing.T) {
	t.Run("stops after a full batch", func(t *testing.T) {
		clock := newFakeClock()
		store := &fakeStore{clock: clock, expired: 10_000, cost: time.Second}
		sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, Pause: 100 * time.Millisecond, MaxDuration: 2500 * time.Millisecond})
		res, err := sw.Once(t.Context())
		require.ErrorIs(t, err, retention.ErrMaxDuration)
		require.Equal(t, retention.StopMaxDuration, res.Stop)
		// 0-1s batch, 1.1-2.1s batch, 2.2-3.2s batch, then no batch starts.
		require.Equal(t, 3, res.Batches)
		require.EqualValues(t, 300, res.Deleted)
		require.Equal(t, expiredFor, res.Lag(), "the lag of what is left")
	})
	t.Run("a pause does not run past it", func(t *testing.T) {
		clock := newFakeClock()
		store := &fakeStore{clock: clock, expired: 10_000, cost: time.Second}
		sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, Pause: time.Hour, MaxDuration: 2 * time.Second})
		res, err := sw.Once(t.Context())
		require.ErrorIs(t, err, retention.ErrMaxDuration)
		require.Equal(t, []time.Duration{time.Second}, clock.Sleeps())
		require.Equal(t, 2*time.Second, res.Duration)
	})
	t.Run("a short last batch has finished", func(t *testing.T) {
		clock := newFakeClock()
		store := &fakeStore{clock: clock, expired: 150, cost: 600 * time.Millisecond}
		sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, MaxDuration: time.Second})
		res, err := sw.Once(t.Context())
		require.NoError(t, err, "the second batch started before the deadline and came back short")
		require.Equal(t, retention.StopFinished, res.Stop)
		require.EqualValues(t, 150, res.Deleted)
		require.Greater(t, res.Duration, time.Second)
	})
}

func TestOnceCancelled(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 10_000}
	ctx, cancel := context.WithCancel(t.Context())
	store.fail = func(ctx context.Context, call, _ int) error {
		if call == 3 {
			cancel()
			return fmt.Errorf("postgres sweep: %w", ctx.Err())
		}
		return nil
	}
	reader := sdkmetric.NewManualReader()
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	res, err := sw.Once(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, retention.StopCanceled, res.Stop)
	require.Zero(t, res.Errors, "a cancellation is no error of the store")
	require.EqualValues(t, 200, res.Deleted)
	m := collect(t, reader)
	require.Zero(t, m.sum(t, retention.MetricErrors, nil))
	require.EqualValues(t, 200, m.sum(t, retention.MetricDeleted, nil))
	require.EqualValues(t, 1, m.histogramCount(t, retention.MetricPassDuration, attribute.String("outcome", "canceled")))
}

func TestMetrics(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 5000, cost: 20 * time.Millisecond}
	store.fail = func(_ context.Context, call, _ int) error {
		switch call {
		case 2:
			return fmt.Errorf("sweep: %w", context.DeadlineExceeded)
		case 3:
			return fmt.Errorf("%w: boom", storage.ErrUnavailable)
		}
		return nil
	}
	reader := sdkmetric.NewManualReader()
	sw := newSweeper(t, store, clock, retention.Config{
		BatchSize: 1000, MaxDuration: 3200 * time.Millisecond,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	})
	res, err := sw.Once(t.Context())
	require.ErrorIs(t, err, retention.ErrMaxDuration)
	// 0-0.02s: 1000 deleted; pause; 0.07-0.09s: timeout, the batch halves;
	// 1s backoff; 1.09-1.11s: error; 2s backoff; 3.11-3.13s: 500 deleted,
	// the batch doubles; pause; 3.18-3.2s: 1000 deleted; max duration.
	require.EqualValues(t, 2500, res.Deleted)
	require.Equal(t, 5, res.Batches)

	m := collect(t, reader)
	require.EqualValues(t, res.Deleted, m.sum(t, retention.MetricDeleted, nil))
	require.EqualValues(t, 3, m.sum(t, retention.MetricBatches, []attribute.KeyValue{attribute.String("outcome", "ok")}))
	require.EqualValues(t, 1, m.sum(t, retention.MetricBatches, []attribute.KeyValue{attribute.String("outcome", "timeout")}))
	require.EqualValues(t, 1, m.sum(t, retention.MetricBatches, []attribute.KeyValue{attribute.String("outcome", "error")}))
	require.EqualValues(t, 1, m.sum(t, retention.MetricErrors, []attribute.KeyValue{attribute.String("op", "sweep"), attribute.String("error.type", "timeout")}))
	require.EqualValues(t, 1, m.sum(t, retention.MetricErrors, []attribute.KeyValue{attribute.String("op", "sweep"), attribute.String("error.type", "error")}))
	require.EqualValues(t, 3, m.histogramCount(t, retention.MetricBatchDuration, attribute.String("outcome", "ok")))
	require.InDelta(t, 0.06, m.histogramSum(t, retention.MetricBatchDuration, attribute.String("outcome", "ok")), 1e-9)
	require.EqualValues(t, 1, m.histogramCount(t, retention.MetricPassDuration, attribute.String("outcome", "max_duration")))
	require.InDelta(t, res.Duration.Seconds(), m.histogramSum(t, retention.MetricPassDuration, attribute.String("outcome", "max_duration")), 1e-9)
	require.InDelta(t, expiredFor.Seconds(), m.gauge(t, retention.MetricLag), 1e-9, "lag: what is left expired 90s ago")
	require.EqualValues(t, 1000, m.gauge(t, retention.MetricBatchSize), "halved after the timeout, doubled back after a quick batch")

	// The store is emptied by the next pass: the lag falls to zero.
	_, err = sw.Once(t.Context())
	require.NoError(t, err)
	m = collect(t, reader)
	require.Zero(t, m.gauge(t, retention.MetricLag))
	require.EqualValues(t, 5000, m.sum(t, retention.MetricDeleted, nil))
}

func TestProgressLogs(t *testing.T) {
	clock := newFakeClock()
	store := &fakeStore{clock: clock, expired: 1000, cost: 400 * time.Millisecond}
	var buf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	sw := newSweeper(t, store, clock, retention.Config{BatchSize: 100, Pause: 100 * time.Millisecond, ProgressInterval: time.Second, Logger: logger})
	_, err := sw.Once(t.Context())
	require.NoError(t, err)

	var progress, finished []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m))
		switch m["msg"] {
		case "sweep progress":
			progress = append(progress, m)
		case "sweep finished":
			finished = append(finished, m)
		}
	}
	// A batch and its pause take 0.5s: progress after the batches ending
	// at 1.4s, 2.4s, 3.4s and 4.4s; the 11th batch is short and ends the pass.
	require.Len(t, progress, 4)
	first := progress[0]
	require.EqualValues(t, 300, first["deleted"])
	require.EqualValues(t, 214.3, first["rate_per_s"], "300 records in 1.4s")
	require.EqualValues(t, expiredFor, first["lag"])
	require.NotEmpty(t, first["oldest_expiry"])
	require.Len(t, finished, 1)
	require.EqualValues(t, 1000, finished[0]["deleted"])
	require.Equal(t, "finished", finished[0]["stop"])
	require.EqualValues(t, 0, finished[0]["lag"])
}

// gatedClock is a fakeClock whose long sleeps (Run's interval) signal and
// wait for the test; short ones (the pauses of a pass) pass at once.
type gatedClock struct {
	*fakeClock
	long    time.Duration
	waiting chan time.Duration
	release chan struct{}
}

func (c *gatedClock) Sleep(ctx context.Context, d time.Duration) error {
	if d < c.long {
		return c.fakeClock.Sleep(ctx, d)
	}
	select {
	case c.waiting <- d:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-c.release:
		return c.fakeClock.Sleep(ctx, d)
	case <-ctx.Done():
		return ctx.Err()
	}
}

func TestRun(t *testing.T) {
	clock := &gatedClock{fakeClock: newFakeClock(), long: 10 * time.Second, waiting: make(chan time.Duration), release: make(chan struct{})}
	store := &fakeStore{clock: clock.fakeClock, expired: 250}
	sw, err := retention.New(store, retention.Config{BatchSize: 100, Interval: time.Minute, Now: clock.Now, Sleep: clock.Sleep})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); sw.Run(ctx) }()

	wait := <-clock.waiting // the first pass ran at once
	require.InDelta(t, time.Minute, wait, float64(6*time.Second), "the interval, jittered by 10%")
	require.Equal(t, []int{100, 100, 100}, store.Limits())
	store.Add(30)
	clock.release <- struct{}{}
	<-clock.waiting
	require.Equal(t, []int{100, 100, 100, 100}, store.Limits(), "the second pass ran after the interval")

	cancel()
	<-done
}

func TestRunAfterMaxDurationGoesOnSoon(t *testing.T) {
	clock := &gatedClock{fakeClock: newFakeClock(), long: 10 * time.Second, waiting: make(chan time.Duration), release: make(chan struct{})}
	store := &fakeStore{clock: clock.fakeClock, expired: 1000, cost: time.Second}
	sw, err := retention.New(store, retention.Config{BatchSize: 100, MaxDuration: 3 * time.Second, Interval: time.Hour,
		Now: clock.Now, Sleep: clock.Sleep, Rand: half})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); sw.Run(ctx) }()
	wait := <-clock.waiting
	require.Equal(t, time.Hour, wait)
	require.Len(t, store.Limits(), 11, "passes follow each other with a pause until the backlog is gone")
	cancel()
	<-done
}

func TestConfigValidate(t *testing.T) {
	require.NoError(t, retention.Config{}.Validate())
	require.NoError(t, retention.Config{BatchSize: 5}.Validate(), "the min batch size follows a small batch size")
	for _, tc := range []struct {
		cfg  retention.Config
		want string
	}{
		{retention.Config{BatchSize: -1}, "batch size must be positive"},
		{retention.Config{BatchSize: 10, MinBatchSize: 20}, "min batch size must be between 1 and the batch size 10"},
		{retention.Config{BatchTimeout: -time.Second}, "batch timeout"},
		{retention.Config{MaxDuration: -time.Second}, "max duration"},
		{retention.Config{MaxErrors: -1}, "max errors"},
		{retention.Config{Interval: -time.Second}, "interval"},
	} {
		require.ErrorContains(t, tc.cfg.Validate(), tc.want)
		_, err := retention.New(&fakeStore{}, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
}

// metrics is one collection of a manual reader.
type metrics struct{ rm metricdata.ResourceMetrics }

func collect(t *testing.T, r *sdkmetric.ManualReader) metrics {
	t.Helper()
	var m metrics
	require.NoError(t, r.Collect(context.Background(), &m.rm))
	return m
}

func (m metrics) find(t *testing.T, name string) metricdata.Aggregation {
	t.Helper()
	for _, sm := range m.rm.ScopeMetrics {
		require.Equal(t, retention.MeterName, sm.Scope.Name)
		for _, x := range sm.Metrics {
			if x.Name == name {
				return x.Data
			}
		}
	}
	return nil
}

// sum adds up the points of a counter whose attributes include attrs.
func (m metrics) sum(t *testing.T, name string, attrs []attribute.KeyValue) int64 {
	t.Helper()
	data := m.find(t, name)
	if data == nil {
		return 0
	}
	s, ok := data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is a %T", name, data)
	require.True(t, s.IsMonotonic)
	var n int64
	for _, p := range s.DataPoints {
		if hasAll(p.Attributes, attrs...) {
			n += p.Value
		}
	}
	return n
}

func (m metrics) histogram(t *testing.T, name string, attr attribute.KeyValue) metricdata.HistogramDataPoint[float64] {
	t.Helper()
	h, ok := m.find(t, name).(metricdata.Histogram[float64])
	require.True(t, ok, "%s is no histogram", name)
	for _, p := range h.DataPoints {
		if hasAll(p.Attributes, attr) {
			return p
		}
	}
	return metricdata.HistogramDataPoint[float64]{}
}

func (m metrics) histogramCount(t *testing.T, name string, attr attribute.KeyValue) uint64 {
	return m.histogram(t, name, attr).Count
}

func (m metrics) histogramSum(t *testing.T, name string, attr attribute.KeyValue) float64 {
	return m.histogram(t, name, attr).Sum
}

func (m metrics) gauge(t *testing.T, name string) float64 {
	t.Helper()
	switch g := m.find(t, name).(type) {
	case metricdata.Gauge[float64]:
		require.Len(t, g.DataPoints, 1)
		return g.DataPoints[0].Value
	case metricdata.Gauge[int64]:
		require.Len(t, g.DataPoints, 1)
		return float64(g.DataPoints[0].Value)
	default:
		t.Fatalf("%s is a %T", name, g)
		return 0
	}
}

func hasAll(set attribute.Set, attrs ...attribute.KeyValue) bool {
	for _, a := range attrs {
		v, ok := set.Value(a.Key)
		if !ok || v != a.Value {
			return false
		}
	}
	return true
}
