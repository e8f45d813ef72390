package pebble

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

func openT(t testing.TB, dir string, opts ...Option) *Store {
	t.Helper()
	s, err := Open(dir, append([]Option{WithLogger(testLogger(t))}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

func TestConformance(t *testing.T) {
	t.Run("Disk", func(t *testing.T) {
		storagetest.Run(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, t.TempDir(), WithClock(c.Now))
		})
	})
	t.Run("InMemory", func(t *testing.T) {
		storagetest.Run(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, "", WithInMemory(), WithClock(c.Now))
		})
	})
}

func TestMembershipConformance(t *testing.T) {
	storagetest.RunMembership(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, "", WithInMemory(), WithClock(c.Now))
	})
}

func TestSweeperConformance(t *testing.T) {
	t.Run("Disk", func(t *testing.T) {
		storagetest.RunSweeper(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, t.TempDir(), WithClock(c.Now))
		})
	})
	t.Run("InMemory", func(t *testing.T) {
		storagetest.RunSweeper(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, "", WithInMemory(), WithClock(c.Now))
		})
	})
}

// fakeClock is a clock that moves only when told to, backwards included.
type fakeClock struct{ ns atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC).UnixNano())
	return c
}

func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

func key(name string) storage.Key {
	return storage.Key{Consumer: "test", Kind: storage.KindOperation, Key: name}
}

func claimP(k storage.Key, lease, retention time.Duration) storage.ClaimParams {
	return storage.ClaimParams{Key: k, Lease: lease, Retention: retention, Holder: "h"}
}

func mustAcquire(t testing.TB, s *Store, p storage.ClaimParams) storage.Record {
	t.Helper()
	res, err := s.Claim(context.Background(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record
}

func mustComplete(t testing.TB, s *Store, k storage.Key, token int64, result string) storage.Record {
	t.Helper()
	rec, err := s.Complete(context.Background(), storage.CompleteParams{Key: k, Token: token, Result: []byte(result)})
	require.NoError(t, err)
	return rec
}

func TestReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)

	done := mustAcquire(t, s, claimP(key("done"), time.Minute, time.Hour))
	done = mustComplete(t, s, key("done"), done.Token, "result")
	first := mustAcquire(t, s, claimP(key("held"), time.Minute, time.Hour))
	_, err = s.Release(t.Context(), storage.ReleaseParams{Key: key("held"), Token: first.Token})
	require.NoError(t, err)
	second := mustAcquire(t, s, claimP(key("held"), time.Minute, time.Hour))
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Ping(t.Context()), storage.ErrUnavailable, "a closed store is unavailable")
	_, err = s.Lookup(t.Context(), key("done"))
	require.ErrorIs(t, err, storage.ErrUnavailable)

	s = openT(t, dir)
	got, err := s.Lookup(t.Context(), key("done"))
	require.NoError(t, err)
	require.Equal(t, done, got)
	got, err = s.Lookup(t.Context(), key("held"))
	require.NoError(t, err)
	require.Equal(t, second, got)

	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: key("held"), Token: first.Token, Result: []byte("zombie")})
	require.ErrorIs(t, err, storage.ErrLeaseLost, "the fence survives a restart")
	mustComplete(t, s, key("held"), second.Token, "winner")
	res, err := s.Claim(t.Context(), claimP(key("done"), time.Minute, time.Hour))
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)
	require.Equal(t, "result", string(res.Record.Result))
}

// TestTokenFloor steps the clock back after a sweep deleted a record: the
// next claim of that key still gets a greater token, before and after a
// restart.
func TestTokenFloor(t *testing.T) {
	dir := t.TempDir()
	clock := newFakeClock()
	s, err := Open(dir, WithClock(clock.Now), WithLogger(testLogger(t)))
	require.NoError(t, err)

	k := key("k")
	rec := mustAcquire(t, s, claimP(k, time.Second, time.Second))
	mustComplete(t, s, k, rec.Token, "r")
	clock.Advance(time.Hour)
	res, err := s.SweepExpired(t.Context(), 10)
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted)

	clock.Advance(-24 * time.Hour)
	again := mustAcquire(t, s, claimP(key("k"), time.Second, time.Second))
	require.Greater(t, again.Token, rec.Token, "the clock stepped back a day")
	mustComplete(t, s, k, again.Token, "r")
	clock.Advance(time.Hour)
	res, err = s.SweepExpired(t.Context(), 10)
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted)
	require.NoError(t, s.Close())

	clock.Advance(-24 * time.Hour)
	s = openT(t, dir, WithClock(clock.Now))
	third := mustAcquire(t, s, claimP(k, time.Second, time.Second))
	require.Greater(t, third.Token, again.Token, "the floor survives a restart")
}

func TestLockSameProcess(t *testing.T) {
	dir := t.TempDir()
	openT(t, dir)
	_, err := Open(dir+"/./", WithLogger(testLogger(t)))
	require.ErrorIs(t, err, ErrLocked)
	require.Contains(t, err.Error(), dir)
	require.Contains(t, err.Error(), "another idemreg")
}

const (
	envLockDir  = "IDEMREG_PEBBLE_TEST_LOCK_DIR"
	envCrashDir = "IDEMREG_PEBBLE_TEST_CRASH_DIR"
)

// TestLockChild is the second process of TestLockSecondProcess.
func TestLockChild(t *testing.T) {
	dir := os.Getenv(envLockDir)
	if dir == "" {
		t.Skip("runs as the child of TestLockSecondProcess")
	}
	s, err := Open(dir, WithLogger(testLogger(t)))
	fmt.Printf("open error: %v\n", err)
	if err == nil {
		require.NoError(t, s.Close())
	}
}

func TestLockSecondProcess(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)

	child := func() (string, error) {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestLockChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), envLockDir+"="+dir)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := child()
	require.NoError(t, err, out)
	require.Contains(t, out, "open error: pebble: data directory is locked: "+dir)

	require.NoError(t, s.Close())
	out, err = child()
	require.NoError(t, err, out)
	require.Contains(t, out, "open error: <nil>", "the child opens the directory once it is released")
}

// TestExpiryIndexConsistent runs random operations, sweeps included, from
// several goroutines and then checks the index holds exactly one entry per
// record, at the record's expires_at.
func TestExpiryIndexConsistent(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, t.TempDir(), WithClock(clock.Now))
	ctx := t.Context()

	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range 400 {
				k := key(fmt.Sprintf("k%d", rng.IntN(40)))
				lease := time.Duration(1+rng.IntN(60)) * time.Second
				switch rng.IntN(7) {
				case 0, 1:
					_, _ = s.Claim(ctx, claimP(k, lease, time.Duration(rng.IntN(120)+1)*time.Second))
				case 2, 3:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Complete(ctx, storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte("r")})
					}
				case 4:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Extend(ctx, storage.ExtendParams{Key: k, Token: rec.Token, Lease: lease})
					}
				case 5:
					if rec, err := s.Lookup(ctx, k); err == nil {
						_, _ = s.Release(ctx, storage.ReleaseParams{Key: k, Token: rec.Token})
					}
				case 6:
					if w == 0 {
						if _, err := s.SweepExpired(ctx, 1+rng.IntN(5)); err != nil {
							t.Error(err)
						}
					}
					clock.Advance(time.Duration(rng.IntN(20)) * time.Second)
				}
			}
		})
	}
	wg.Wait()

	records, index := scan(t, s)
	require.NotEmpty(t, records)
	require.Len(t, index, len(records), "one index entry per record")
	for k, rec := range records {
		exp, ok := index[k]
		require.True(t, ok, "record %q has no index entry", k)
		require.True(t, exp.Equal(rec.ExpiresAt), "index says %v, record %v", exp, rec.ExpiresAt)
	}
}

// scan reads every record and every index entry, keyed by record key.
func scan(t testing.TB, s *Store) (records map[string]storage.Record, index map[string]time.Time) {
	t.Helper()
	records, index = map[string]storage.Record{}, map[string]time.Time{}
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixRecord}, UpperBound: []byte{prefixExpiry + 1}})
	require.NoError(t, err)
	for ok := it.First(); ok; ok = it.Next() {
		switch it.Key()[0] {
		case prefixRecord:
			k, err := decodeRecordKey(it.Key())
			require.NoError(t, err)
			rec := storage.Record{Key: k}
			require.NoError(t, decodeRecord(it.Value(), &rec))
			records[string(it.Key())] = rec
		case prefixExpiry:
			exp, rk, err := decodeExpiryKey(it.Key())
			require.NoError(t, err)
			_, dup := index[string(rk)]
			require.False(t, dup, "two index entries for %q", rk)
			index[string(rk)] = exp
		}
	}
	require.NoError(t, it.Close())
	return records, index
}

func TestSweep(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	ctx := t.Context()

	_, _, ok, err := s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.False(t, ok, "an empty store has no oldest expiry")

	// Expiries 1h, 2h, ... 5h from now, claimed in reverse order.
	var recs []storage.Record
	for i := 5; i >= 1; i-- {
		recs = append([]storage.Record{mustAcquire(t, s, claimP(key(fmt.Sprint(i)), time.Second, time.Duration(i)*time.Hour-time.Second))}, recs...)
	}
	oldest, now, ok, err := s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, recs[0].ExpiresAt, oldest)
	require.Equal(t, clock.Now().UTC(), now)

	res, err := s.SweepExpired(ctx, 10)
	require.NoError(t, err)
	require.Zero(t, res.Deleted, "nothing has expired")

	clock.Advance(3*time.Hour + time.Minute)
	res, err = s.SweepExpired(ctx, 2)
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Equal(t, clock.Now().UTC(), res.Now)
	oldest, _, _, err = s.OldestExpiry(ctx)
	require.NoError(t, err)
	require.Equal(t, recs[2].ExpiresAt, oldest, "the oldest two went first")

	res, err = s.SweepExpired(ctx, 2)
	require.NoError(t, err)
	require.Equal(t, 1, res.Deleted, "a short batch: only one more has expired")
	for i, rec := range recs {
		_, err := s.Lookup(ctx, rec.Key)
		if i < 3 {
			require.ErrorIs(t, err, storage.ErrNotFound)
		} else {
			require.NoError(t, err, "a live record is never swept")
		}
	}
	records, index := scan(t, s)
	require.Len(t, records, 2)
	require.Len(t, index, 2)
}

// TestSweepKeepsReclaimed re-claims an expired record between the sweep's
// index scan and its delete: the sweep keeps it.
func TestSweepKeepsReclaimed(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	k := key("k")
	first := mustAcquire(t, s, claimP(k, time.Second, time.Minute))
	clock.Advance(time.Hour)

	var second storage.Record
	s.afterScan = func() { second = mustAcquire(t, s, claimP(k, time.Second, time.Minute)) }
	res, err := s.SweepExpired(t.Context(), 10)
	require.NoError(t, err)
	require.Zero(t, res.Deleted)
	require.Greater(t, second.Token, first.Token)
	got, err := s.Lookup(t.Context(), k)
	require.NoError(t, err)
	require.Equal(t, second, got)
	records, index := scan(t, s)
	require.Len(t, records, 1)
	require.Len(t, index, 1)
}

// TestPowerLoss takes a crash image of the file system (only what was synced)
// while calls are running and checks that every call that had returned is
// in it.
func TestPowerLoss(t *testing.T) {
	fs := vfs.NewCrashableMem()
	s, err := Open("/data", withFS(fs), WithLogger(testLogger(t)))
	require.NoError(t, err)

	var (
		mu       sync.Mutex
		acked    []storage.Record
		enough   = make(chan struct{})
		signal   sync.Once
		stop     atomic.Bool
		wg       sync.WaitGroup
		finished = make(chan struct{})
		ctx      = context.Background()
		returns  []storage.Record
	)
	for w := range 16 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				k := key(fmt.Sprintf("w%d-%d", w, i))
				res, err := s.Claim(ctx, claimP(k, time.Minute, time.Hour))
				if err != nil {
					t.Error(err)
					return
				}
				rec := res.Record
				if i%2 == 0 {
					if rec, err = s.Complete(ctx, storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte("result-" + k.Key)}); err != nil {
						t.Error(err)
						return
					}
				}
				mu.Lock()
				acked = append(acked, rec)
				if len(acked) >= 2000 {
					signal.Do(func() { close(enough) })
				}
				mu.Unlock()
			}
		})
	}
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-enough:
	case <-finished:
		t.Fatal("the writers stopped early")
	}
	// Everything acknowledged so far returned before the image is taken.
	mu.Lock()
	returns = append(returns, acked...)
	mu.Unlock()
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	stop.Store(true)
	<-finished
	require.NoError(t, s.Close())

	s = openT(t, "/data", withFS(crashed))
	for _, want := range returns {
		got, err := s.Lookup(t.Context(), want.Key)
		require.NoError(t, err, "acknowledged %s lost", want.Key.Key)
		require.Equal(t, want, got)
	}
	t.Logf("%d acknowledged records survived", len(returns))
}

// TestCrashChild is the process TestCrash kills: it runs claims and completes
// on the data directory and prints every acknowledged one.
func TestCrashChild(t *testing.T) {
	dir := os.Getenv(envCrashDir)
	if dir == "" {
		t.Skip("runs as the child of TestCrash")
	}
	s, err := Open(dir, WithLogger(testLogger(t)))
	require.NoError(t, err)
	var mu sync.Mutex
	ack := func(format string, args ...any) {
		line := fmt.Sprintf("ack "+format+"\n", args...)
		mu.Lock()
		defer mu.Unlock()
		_, _ = io.WriteString(os.Stdout, line)
	}
	deadline := time.Now().Add(time.Minute) // the parent kills us long before
	var wg sync.WaitGroup
	ctx := context.Background()
	for w := range 16 {
		wg.Go(func() {
			for i := 0; time.Now().Before(deadline); i++ {
				k := key(fmt.Sprintf("w%d-%d", w, i))
				res, err := s.Claim(ctx, claimP(k, time.Hour, time.Hour))
				if err != nil {
					t.Error(err)
					return
				}
				ack("claim %s %d", k.Key, res.Record.Token)
				if i%4 == 0 {
					// Release and claim again, so there is an older
					// token that must stay fenced.
					if _, err := s.Release(ctx, storage.ReleaseParams{Key: k, Token: res.Record.Token}); err != nil {
						t.Error(err)
						return
					}
					if res, err = s.Claim(ctx, claimP(k, time.Hour, time.Hour)); err != nil {
						t.Error(err)
						return
					}
					ack("claim %s %d", k.Key, res.Record.Token)
				}
				if _, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("result-" + k.Key)}); err != nil {
					t.Error(err)
					return
				}
				ack("complete %s %d", k.Key, res.Record.Token)
			}
		})
	}
	wg.Wait()
}

// TestCrash SIGKILLs a process in the middle of a stream of claims and
// completes, reopens its directory and checks everything it acknowledged.
func TestCrash(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("needs SIGKILL")
	}
	dir := t.TempDir()
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashDir+"="+dir)
	cmd.Stderr = t.Output()
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())

	type acked struct {
		tokens    []int64 // in the order claimed
		completed int64
	}
	keys := map[string]*acked{}
	completes := 0
	killed := false
	lines := bufio.NewScanner(stdout)
	for lines.Scan() {
		f := strings.Fields(lines.Text())
		if len(f) != 4 || f[0] != "ack" {
			continue
		}
		token, err := strconv.ParseInt(f[3], 10, 64)
		require.NoError(t, err)
		a := keys[f[2]]
		if a == nil {
			a = &acked{}
			keys[f[2]] = a
		}
		switch f[1] {
		case "claim":
			a.tokens = append(a.tokens, token)
		case "complete":
			a.completed = token
			completes++
		}
		// Kill mid-stream; lines already in the pipe are read after.
		if completes >= 1000 && !killed {
			require.NoError(t, cmd.Process.Kill())
			killed = true
		}
	}
	require.NoError(t, lines.Err())
	require.True(t, killed, "the child stopped before it was killed")
	require.Error(t, cmd.Wait())
	require.Equal(t, -1, cmd.ProcessState.ExitCode(), "killed by a signal")

	s := openT(t, dir)
	ctx := t.Context()
	for name, a := range keys {
		k := key(name)
		last := a.tokens[len(a.tokens)-1]
		for _, old := range a.tokens[:len(a.tokens)-1] {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: old, Result: []byte("zombie")})
			require.ErrorIs(t, err, storage.ErrLeaseLost, "key %s: acknowledged token %d is no longer fenced", name, old)
		}
		if a.completed != 0 {
			require.Equal(t, last, a.completed)
			got, err := s.Lookup(ctx, k)
			require.NoError(t, err, "key %s: acknowledged complete lost", name)
			require.Equal(t, storage.StateCompleted, got.State)
			require.Equal(t, a.completed, got.Token)
			require.Equal(t, "result-"+name, string(got.Result))
			continue
		}
		// Claimed but not acknowledged as completed: the claim holds, or a
		// later one the child made but had not acknowledged yet.
		got, err := s.Lookup(ctx, k)
		require.NoError(t, err, "key %s: acknowledged claim %d lost", name, last)
		require.GreaterOrEqual(t, got.Token, last, "key %s: acknowledged claim %d lost", name, last)
		if got.Token == last {
			rec, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: last, Result: []byte("result-" + name)})
			require.NoError(t, err)
			require.Equal(t, "result-"+name, string(rec.Result))
		}
	}
	t.Logf("checked %d keys, %d acknowledged completes", len(keys), completes)
}

func BenchmarkClaimComplete(b *testing.B) {
	s := openT(b, b.TempDir())
	procs := runtime.GOMAXPROCS(0)
	b.SetParallelism((64 + procs - 1) / procs)
	var seq atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			k := storage.Key{Consumer: "bench", Kind: storage.KindOperation, Key: strconv.FormatInt(seq.Add(1), 10)}
			res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Fingerprint: []byte("fingerprint"), Lease: time.Minute, Retention: time.Hour, Holder: "bench"})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("a small result")}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
}
