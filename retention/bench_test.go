package retention_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// BenchmarkSweepUnderClaimLoad fills a PostgreSQL table with a million
// expired and a million live records and runs a paced load of Claims (80%
// new keys, 20% replays of live records) while the sweeper, with its
// defaults, deletes the expired ones. The sweeper works in windows of 10s
// that alternate with windows of the load alone, so that both sets of
// latencies see the same machine (a shared one drifts). It reports the
// deletion rate while sweeping and the Claim latencies with and without
// the sweeper.
//
//	go test -run '^$' -bench SweepUnderClaimLoad -benchtime 1x -timeout 60m ./retention/
//
// IDEMREG_BENCH_EXPIRED, IDEMREG_BENCH_LIVE, IDEMREG_BENCH_CLAIM_RATE (per
// second), IDEMREG_BENCH_WINDOW (a duration) and IDEMREG_BENCH_BATCH_SIZE
// change the sizes. -short skips it.
func BenchmarkSweepUnderClaimLoad(b *testing.B) {
	if testing.Short() {
		b.Skip("loads two million rows")
	}
	var (
		nExpired  = envInt(b, "IDEMREG_BENCH_EXPIRED", 1_000_000)
		nLive     = envInt(b, "IDEMREG_BENCH_LIVE", 1_000_000)
		rate      = envInt(b, "IDEMREG_BENCH_CLAIM_RATE", 1000)
		batchSize = envInt(b, "IDEMREG_BENCH_BATCH_SIZE", retention.DefaultBatchSize)
		window    = 10 * time.Second
	)
	if v := os.Getenv("IDEMREG_BENCH_WINDOW"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(b, err)
		window = d
	}
	for b.Loop() {
		ctx := context.Background()
		dbURL := pgtest.NewDatabase(b)
		t0 := time.Now()
		// Expired over the last day, live for the next one; completed, as
		// most records are.
		insertRecords(ctx, b, dbURL, "expired", nExpired, true, "now() - interval '1 millisecond' - (i % 86400000) * interval '1 millisecond'")
		insertRecords(ctx, b, dbURL, "live", nLive, true, "now() + interval '1 hour' + (i % 86400000) * interval '1 millisecond'")
		_, err := pgUpdate(ctx, dbURL, "VACUUM ANALYZE idemreg_records")
		require.NoError(b, err)
		b.Logf("loaded %d expired and %d live records in %v", nExpired, nLive, time.Since(t0).Round(time.Millisecond))

		claims, err := postgres.Open(ctx, dbURL)
		require.NoError(b, err)
		sweepStore, err := postgres.Open(ctx, dbURL)
		require.NoError(b, err)
		sw, err := retention.New(sweepStore, retention.Config{BatchSize: batchSize, MaxDuration: window})
		require.NoError(b, err)

		load := &claimLoad{store: claims, rate: rate, nLive: nLive}
		var (
			before, during  samples
			deleted         int64
			sweeping        time.Duration
			batches, failed int
		)
		for {
			before.add(load.run(ctx, func(ctx context.Context) { <-ctx.Done() }, window))
			var res retention.Result
			during.add(load.run(ctx, func(ctx context.Context) { res, err = sw.Once(ctx) }, 0))
			deleted += res.Deleted
			sweeping += res.Duration
			batches += res.Batches
			failed += res.Errors
			if err == nil {
				break
			}
			require.ErrorIs(b, err, retention.ErrMaxDuration)
		}
		require.EqualValues(b, nExpired, deleted)
		claims.Close()
		sweepStore.Close()

		deletedPerSec := float64(deleted) / sweeping.Seconds()
		b.ReportMetric(deletedPerSec, "deleted/s")
		b.ReportMetric(ms(before.quantile(0.50)), "claim-p50-ms")
		b.ReportMetric(ms(before.quantile(0.99)), "claim-p99-ms")
		b.ReportMetric(ms(during.quantile(0.50)), "sweeping-claim-p50-ms")
		b.ReportMetric(ms(during.quantile(0.99)), "sweeping-claim-p99-ms")
		b.Logf("sweeper: deleted %d records in %v of sweeping: %.0f/s, %d batches of up to %d, %d failed",
			deleted, sweeping.Round(time.Millisecond), deletedPerSec, batches, batchSize, failed)
		b.Logf("claims without the sweeper: %s", before)
		b.Logf("claims while sweeping:      %s", during)
	}
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(b, err, name)
	return n
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// claimLoad issues Claims at a fixed total rate from a pool of workers.
type claimLoad struct {
	store *postgres.Store
	rate  int
	nLive int
	seq   int
}

// samples are Claim latencies gathered over one or more windows.
type samples struct {
	d       []time.Duration
	errors  int
	elapsed time.Duration
}

func (s *samples) add(o samples) {
	s.d = append(s.d, o.d...)
	s.errors += o.errors
	s.elapsed += o.elapsed
}

func (s *samples) quantile(q float64) time.Duration {
	if len(s.d) == 0 {
		return 0
	}
	slices.Sort(s.d)
	return s.d[min(len(s.d)-1, int(q*float64(len(s.d))))]
}

func (s samples) String() string {
	return fmt.Sprintf("%d claims in %v (%.0f/s, %d errors): p50 %v, p99 %v, max %v",
		len(s.d), s.elapsed.Round(time.Millisecond), float64(len(s.d))/s.elapsed.Seconds(), s.errors,
		s.quantile(0.50).Round(10*time.Microsecond), s.quantile(0.99).Round(10*time.Microsecond), s.quantile(1).Round(10*time.Microsecond))
}

// run runs the load while during runs, for at least d.
func (l *claimLoad) run(ctx context.Context, during func(ctx context.Context), d time.Duration) samples {
	const workers = 16
	l.seq++
	ctx, cancel := context.WithCancel(ctx)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		all     []time.Duration
		errs    int
		start   = time.Now()
		perWork = time.Duration(float64(time.Second) * workers / float64(l.rate))
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(w), uint64(l.seq)))
			var own []time.Duration
			bad := 0
			next := start.Add(time.Duration(w) * perWork / workers)
			for i := 0; ; i++ {
				if wait := time.Until(next); wait > 0 {
					select {
					case <-ctx.Done():
					case <-time.After(wait):
					}
				}
				if ctx.Err() != nil {
					break
				}
				next = next.Add(perWork)
				p := storage.ClaimParams{Lease: 30 * time.Second, Retention: time.Hour, Holder: "bench", Fingerprint: []byte("fp")}
				if rnd.IntN(5) == 0 {
					p.Key = storage.Key{Consumer: "live", Kind: storage.KindMessage, Key: "key-" + strconv.Itoa(rnd.IntN(l.nLive))}
				} else {
					p.Key = storage.Key{Consumer: "new", Kind: storage.KindMessage, Key: fmt.Sprintf("%d-%d-%d", l.seq, w, i)}
				}
				t0 := time.Now()
				_, err := l.store.Claim(context.WithoutCancel(ctx), p)
				own = append(own, time.Since(t0))
				if err != nil {
					bad++
				}
			}
			mu.Lock()
			all = append(all, own...)
			errs += bad
			mu.Unlock()
		}()
	}
	done := make(chan struct{})
	go func() { defer close(done); during(ctx) }()
	if d > 0 {
		time.Sleep(d)
		cancel()
	}
	<-done
	cancel()
	wg.Wait()
	return samples{d: all, errors: errs, elapsed: time.Since(start)}
}
