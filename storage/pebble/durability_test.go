package pebble

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

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
