package retention_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// TestConcurrentSweepersOnPostgres runs several sweepers, each on a store of
// its own (as in separate processes), over the same expired records while
// Claims run: of new keys, of live records, and, in the second case, of
// expired records that a sweeper may be deleting at that moment. Together
// the sweepers delete each expired record once and no live one.
func TestConcurrentSweepersOnPostgres(t *testing.T) {
	for _, reclaim := range []int{0, 200} {
		t.Run(fmt.Sprintf("reclaim=%d", reclaim), func(t *testing.T) {
			testConcurrentSweepers(t, pgtest.ServerURL(), reclaim)
		})
	}
}

// TestConcurrentSweepersOnCockroach is the same on a live CockroachDB
// cluster, when IDEMREG_TEST_COCKROACH_URL names one.
func TestConcurrentSweepersOnCockroach(t *testing.T) {
	serverURL := os.Getenv("IDEMREG_TEST_COCKROACH_URL")
	if serverURL == "" {
		t.Skip("IDEMREG_TEST_COCKROACH_URL not set: no CockroachDB cluster on this machine")
	}
	testConcurrentSweepers(t, serverURL, 200)
}

func testConcurrentSweepers(t *testing.T, serverURL string, reclaim int) {
	const (
		sweepers  = 4
		claimers  = 4
		nExpired  = 3000
		nLive     = 500
		batchSize = 50
	)
	ctx := t.Context()
	dbURL := pgtest.NewDatabaseAt(t, serverURL)
	// Expired between 1ms and an hour ago; live ones for another hour, half
	// of them in progress with a live lease, half completed.
	insertRecords(ctx, t, dbURL, "expired", nExpired, true, "now() - interval '1 millisecond' - (i % 3600) * interval '1 second'")
	insertRecords(ctx, t, dbURL, "live.in-progress", nLive, false, "now() + interval '2 hours' + i * interval '1 millisecond'")
	insertRecords(ctx, t, dbURL, "live.completed", nLive, true, "now() + interval '1 hour' + i * interval '1 millisecond'")
	_, err := pgUpdate(ctx, dbURL, `UPDATE idemreg_records SET lease_expires_at = now() + interval '1 hour' WHERE consumer = 'live.in-progress'`)
	require.NoError(t, err)
	liveBefore := map[string]map[string]int64{
		"live.in-progress": tokens(t, dbURL, "live.in-progress"),
		"live.completed":   tokens(t, dbURL, "live.completed"),
	}

	var sweepStatements statementCounter
	open := func() *postgres.Store {
		s, err := postgres.Open(ctx, dbURL, postgres.WithTracer(&sweepStatements))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	claimStore := open()

	var (
		wg       sync.WaitGroup
		results  = make([]retention.Result, sweepers)
		errs     = make([]error, sweepers)
		sweeping atomic.Int32
	)
	sweeping.Store(sweepers)
	start := make(chan struct{})
	for i := range sweepers {
		sw, err := retention.New(open(), retention.Config{BatchSize: batchSize})
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer sweeping.Add(-1)
			<-start
			results[i], errs[i] = sw.Once(ctx)
		}()
	}

	type claimErr struct {
		key storage.Key
		err error
	}
	var (
		cwg       sync.WaitGroup
		failures  = make(chan claimErr, 100)
		reclaimed = make(chan string, reclaim)
		newKeys   atomic.Int64
		liveHits  atomic.Int64
		next      atomic.Int64 // the next expired key to claim again
	)
	for c := range claimers {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			<-start
			rnd := rand.New(rand.NewPCG(uint64(c), 7))
			for sweeping.Load() > 0 || next.Load() < int64(reclaim) {
				var (
					p    = storage.ClaimParams{Lease: time.Minute, Retention: time.Hour, Holder: "claimer"}
					want storage.Outcome
				)
				switch r := rnd.IntN(3); {
				case r == 0 && next.Load() < int64(reclaim):
					n := next.Add(1) - 1
					if n >= int64(reclaim) {
						continue
					}
					p.Key = storage.Key{Consumer: "expired", Kind: storage.KindMessage, Key: fmt.Sprintf("key-%d", n*int64(nExpired/max(reclaim, 1)))}
					want = storage.OutcomeAcquired
					reclaimed <- p.Key.Key
				case r == 1:
					consumer := "live.in-progress"
					want = storage.OutcomeInProgress
					if rnd.IntN(2) == 0 {
						consumer, want = "live.completed", storage.OutcomeCompleted
					}
					p.Key = storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: fmt.Sprintf("key-%d", rnd.IntN(nLive))}
					p.Fingerprint = []byte("fp")
					liveHits.Add(1)
				default:
					p.Key = storage.Key{Consumer: "new", Kind: storage.KindOperation, Key: fmt.Sprintf("new-%d", newKeys.Add(1))}
					want = storage.OutcomeAcquired
				}
				res, err := claimStore.Claim(ctx, p)
				if err == nil && res.Outcome != want {
					err = fmt.Errorf("outcome %v, want %v", res.Outcome, want)
				}
				if err != nil {
					failures <- claimErr{p.Key, err}
					return
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	cwg.Wait()
	close(failures)
	close(reclaimed)
	for f := range failures {
		t.Errorf("claim of %v: %v", f.key, f.err)
	}

	var deleted int64
	batches, storeErrors := 0, 0
	for i := range sweepers {
		require.NoError(t, errs[i], "sweeper %d", i)
		require.Equal(t, retention.StopFinished, results[i].Stop)
		deleted += results[i].Deleted
		batches += results[i].Batches
		storeErrors += results[i].Errors
	}
	left, expiredLeft := countRecords(t, dbURL, "expired")
	require.Zero(t, expiredLeft, "no expired record is left")
	require.Equal(t, reclaim, left, "every record claimed again is kept")
	for k := range reclaimed {
		_, err := claimStore.Lookup(ctx, storage.Key{Consumer: "expired", Kind: storage.KindMessage, Key: k})
		require.NoError(t, err, "claimed again during the sweep, then deleted: %s", k)
	}
	if reclaim == 0 {
		require.EqualValues(t, nExpired, deleted, "each expired record deleted once in total")
	} else {
		// A record claimed again before a sweeper reached it is kept;
		// one deleted first is inserted anew: both are right.
		require.GreaterOrEqual(t, deleted, int64(nExpired-reclaim))
		require.LessOrEqual(t, deleted, int64(nExpired))
	}
	for consumer, before := range liveBefore {
		require.Equal(t, before, tokens(t, dbURL, consumer), "%s: no live record was deleted or changed", consumer)
	}
	news, _ := countRecords(t, dbURL, "new")
	require.EqualValues(t, newKeys.Load(), news, "every new claim is kept")
	require.Positive(t, liveHits.Load())
	// The double work: sweep statements run again after a serialization
	// failure, when two sweepers picked the same oldest rows.
	t.Logf("%d sweepers deleted %d records (shares %v) in %d batches (%d failed) and %d sweep statements; %d new claims, %d claims of live records",
		sweepers, deleted, shares(results), batches, storeErrors, sweepStatements.n.Load(), newKeys.Load(), liveHits.Load())
}

// statementCounter counts the sweep statements sent, retries included.
type statementCounter struct{ n atomic.Int64 }

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "DELETE FROM idemreg_records") {
		c.n.Add(1)
	}
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func shares(rs []retention.Result) []int64 {
	out := make([]int64, len(rs))
	for i, r := range rs {
		out[i] = r.Deleted
	}
	return out
}
