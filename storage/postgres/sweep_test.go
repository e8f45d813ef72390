package postgres_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// sweepTracer records the cursor ($3) of every sweep statement the store
// sends.
type sweepTracer struct {
	mu      sync.Mutex
	froms   []time.Time
	oldests []time.Time // the cursor of each OldestExpiry
}

func (c *sweepTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch d.SQL {
	case postgres.SweepSQL:
		c.froms = append(c.froms, d.Args[2].(time.Time))
	case postgres.OldestExpirySQL:
		c.oldests = append(c.oldests, d.Args[1].(time.Time))
	}
	return ctx
}

func (c *sweepTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *sweepTracer) last(t *testing.T) time.Time {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	require.NotEmpty(t, c.froms, "no sweep statement sent")
	return c.froms[len(c.froms)-1]
}

type cursorFixture struct {
	s      *postgres.Store
	clock  *storagetest.Clock
	tracer *sweepTracer
	url    string
	n      int
}

func newCursorFixture(t *testing.T, opts ...postgres.Option) *cursorFixture {
	f := &cursorFixture{clock: &storagetest.Clock{}, tracer: &sweepTracer{}}
	opts = append([]postgres.Option{postgres.WithClockOffset(f.clock.Offset), postgres.WithTracer(f.tracer)}, opts...)
	f.url = pgtest.NewDatabase(t)
	f.s = openStore(t, f.url, opts...)
	return f
}

// claim writes a record that expires after lease and returns its expiry.
func (f *cursorFixture) claim(t *testing.T, lease time.Duration) time.Time {
	t.Helper()
	f.n++
	res, err := f.s.Claim(t.Context(), storage.ClaimParams{
		Key:    storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: fmt.Sprintf("k%03d", f.n)},
		Lease:  lease,
		Holder: "h",
	})
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record.ExpiresAt
}

func (f *cursorFixture) sweep(t *testing.T, limit int) storage.SweepResult {
	t.Helper()
	res, err := f.s.SweepExpired(t.Context(), limit)
	require.NoError(t, err)
	return res
}

func (f *cursorFixture) count(t *testing.T) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), f.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT count(*) FROM idemreg_records`).Scan(&n))
	return n
}

// TestSweepStartsAfterCursor: after the first batch, each sweep statement
// starts its scan at the latest expiry the batch before it deleted, not at
// the oldest (issue 16 item 2), and the scan's index condition holds that
// lower bound.
func TestSweepStartsAfterCursor(t *testing.T) {
	f := newCursorFixture(t)
	var expiries []time.Time
	for range 9 {
		expiries = append(expiries, f.claim(t, time.Second))
		f.clock.Advance(time.Minute)
	}
	f.clock.Advance(24 * time.Hour)

	res := f.sweep(t, 3)
	require.Equal(t, 3, res.Deleted)
	require.True(t, f.tracer.last(t).IsZero(), "the first batch starts from the oldest expiry")
	for batch := 1; batch < 3; batch++ {
		res = f.sweep(t, 3)
		require.Equal(t, 3, res.Deleted)
		require.True(t, f.tracer.last(t).Equal(expiries[3*batch-1]),
			"batch %d starts at the last expiry deleted before it: %s, want %s", batch, f.tracer.last(t), expiries[3*batch-1])
	}
	// Short batches move it no further: a batch that deleted fewer than
	// its limit is no proof that nothing was left after its pick (another
	// sweeper may have deleted what it picked).
	res = f.sweep(t, 3)
	require.Zero(t, res.Deleted)
	res2 := f.sweep(t, 3)
	require.Zero(t, res2.Deleted)
	require.True(t, f.tracer.last(t).Equal(expiries[8]), "after a short batch the cursor stays at the last expiry deleted")

	// The lag read starts at the cursor too.
	live := f.claim(t, time.Hour)
	oldest, _, ok, err := f.s.OldestExpiry(t.Context())
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, oldest.Equal(live))
	f.sweep(t, 3)
	cursor := f.tracer.last(t)
	require.False(t, cursor.IsZero())
	f.tracer.mu.Lock()
	read := f.tracer.oldests[len(f.tracer.oldests)-1]
	f.tracer.mu.Unlock()
	require.True(t, read.Equal(cursor), "OldestExpiry reads from the cursor the next batch starts at")

	// The statement's lower bound is an index condition, not a filter
	// applied after a scan from the oldest expiry.
	conn, err := pgx.Connect(t.Context(), f.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), `SET enable_seqscan = off`)
	require.NoError(t, err)
	rows, err := conn.Query(t.Context(), `EXPLAIN `+postgres.SweepSQL, int64(3), int64(0), time.Now())
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	require.Regexp(t, `Index Cond: \(\(expires_at >= .*\) AND \(expires_at <= `, plan)
}

// TestSweepCursorEdges: the records a cursor could leave behind are swept.
func TestSweepCursorEdges(t *testing.T) {
	t.Run("WrittenWithinTheLag", func(t *testing.T) {
		// A writer whose clock reads behind the sweeper's (another
		// CockroachDB gateway, a transaction that read now() long before it
		// committed) writes an expiry before the horizon already swept, but
		// within the lag: the next batch still finds it.
		f := newCursorFixture(t)
		f.claim(t, time.Second)
		f.clock.Advance(time.Hour)
		require.Equal(t, 1, f.sweep(t, 10).Deleted)
		f.clock.Advance(-30 * time.Second)
		f.claim(t, time.Second)
		f.clock.Advance(30 * time.Second)
		require.Equal(t, 1, f.sweep(t, 10).Deleted)
		require.Zero(t, f.count(t))
	})
	t.Run("ClockSteppedBack", func(t *testing.T) {
		// A horizon earlier than the last one resets the cursor.
		f := newCursorFixture(t)
		f.claim(t, time.Second)
		f.clock.Advance(time.Hour)
		require.Equal(t, 1, f.sweep(t, 10).Deleted)
		require.Zero(t, f.sweep(t, 10).Deleted)
		require.False(t, f.tracer.last(t).IsZero())
		f.clock.Advance(-2 * time.Hour)
		f.claim(t, time.Second)
		f.clock.Advance(time.Minute)
		// The batch that sees the earlier horizon still ran from the
		// cursor; it resets it for the next one.
		require.Zero(t, f.sweep(t, 10).Deleted)
		require.Equal(t, 1, f.sweep(t, 10).Deleted, "the batch after the step back starts from the oldest expiry")
		require.True(t, f.tracer.last(t).IsZero())
		require.Zero(t, f.count(t))
	})
	t.Run("BehindByMoreThanTheLag", func(t *testing.T) {
		// A record expiring before the cursor by more than the lag, written
		// without a horizon going back in between, waits for the rescan:
		// deleted late, never kept.
		f := newCursorFixture(t)
		f.claim(t, 2*time.Hour)
		f.clock.Advance(3 * time.Hour)
		require.Equal(t, 1, f.sweep(t, 10).Deleted) // the cursor: that record's expiry
		f.clock.Advance(-(time.Hour + 50*time.Minute))
		f.claim(t, time.Second) // expires an hour before the cursor
		f.clock.Advance(time.Hour + 50*time.Minute + time.Second)
		require.Zero(t, f.sweep(t, 10).Deleted, "below the cursor: left for the rescan")
		require.Equal(t, 1, f.count(t))
		f.clock.Advance(postgres.DefaultSweepRescanEvery)
		// The batch that sees the hour pass notes it; the one after it
		// rescans.
		require.Zero(t, f.sweep(t, 10).Deleted)
		require.Equal(t, 1, f.sweep(t, 10).Deleted, "the rescan finds it")
		require.True(t, f.tracer.last(t).IsZero())
		require.Zero(t, f.count(t))
	})
	t.Run("TiesAtTheCursor", func(t *testing.T) {
		// Records sharing the last deleted expiry, cut by the LIMIT, are
		// found by the next batch: the cursor is inclusive.
		f := newCursorFixture(t)
		params := make([]storage.ClaimParams, 6)
		for i := range params {
			params[i] = storage.ClaimParams{Key: storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: fmt.Sprintf("tie%d", i)}, Lease: time.Second, Holder: "h"}
		}
		results := f.s.ClaimBatch(t.Context(), params)
		for _, r := range results {
			require.NoError(t, r.Err)
			require.True(t, r.Result.Record.ExpiresAt.Equal(results[0].Result.Record.ExpiresAt), "one statement, one now()")
		}
		f.clock.Advance(time.Hour)
		require.Equal(t, 4, f.sweep(t, 4).Deleted)
		require.Equal(t, 2, f.sweep(t, 4).Deleted)
		require.Zero(t, f.count(t))
	})
	t.Run("Off", func(t *testing.T) {
		f := newCursorFixture(t, postgres.WithSweepCursor(0, 0))
		f.claim(t, time.Second)
		f.claim(t, time.Second)
		f.clock.Advance(time.Hour)
		require.Equal(t, 1, f.sweep(t, 1).Deleted)
		require.Equal(t, 1, f.sweep(t, 1).Deleted)
		require.True(t, f.tracer.last(t).IsZero())
	})
}
