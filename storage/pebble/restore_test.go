package pebble

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// copyBackup copies the files of c into a new directory beside dataDir, as
// the backup command and restore do, and returns it.
func copyBackup(t *testing.T, c storage.BackupCopy, parent string) string {
	t.Helper()
	dir, err := os.MkdirTemp(parent, "restore-")
	require.NoError(t, err)
	for _, f := range c.Manifest().Files {
		out, err := os.Create(filepath.Join(dir, f.Name))
		require.NoError(t, err)
		buf := make([]byte, 64<<10)
		var off int64
		for {
			n, err := c.ReadAt(f.Name, buf, off)
			_, werr := out.Write(buf[:n])
			require.NoError(t, werr)
			off += int64(n)
			if err == io.EOF {
				break
			}
			require.NoError(t, err)
		}
		require.NoError(t, out.Close())
		require.Equal(t, f.Size, off, f.Name)
	}
	return dir
}

// TestBackupRestoreKeepsFencing takes a backup while writers run, goes on
// writing on the timeline the backup will lose, restores in place of that
// timeline's directory with a clock far behind the one it ran on, and
// checks: the completions acknowledged before the backup replay; a token
// of the lost timeline is refused; every token issued after the restore
// exceeds every token issued before it.
func TestBackupRestoreKeepsFencing(t *testing.T) {
	ctx := t.Context()
	parent := t.TempDir()
	dataDir := filepath.Join(parent, "data")
	clock := newFakeClock() // 2030: far ahead of the restore's clock
	s, err := Open(dataDir, WithLogger(testLogger(t)), WithClock(clock.Now))
	require.NoError(t, err)

	acked := map[string]int64{} // key -> completed token, acknowledged before the backup
	for i := range 50 {
		k := key(fmt.Sprintf("before-%d", i))
		rec := mustAcquire(t, s, claimP(k, time.Minute, 24*time.Hour))
		_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: rec.Token, Result: []byte(k.Key)})
		require.NoError(t, err)
		acked[k.Key] = rec.Token
	}
	held := mustAcquire(t, s, claimP(key("held"), 3*time.Hour, time.Hour))
	mustAcquire(t, s, claimP(key("taken"), time.Hour, 24*time.Hour))

	// Writers run while the checkpoint is taken.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := key(fmt.Sprintf("during-%d-%d", w, i))
				if res, err := s.Claim(ctx, claimP(k, time.Minute, time.Hour)); err == nil {
					_, _ = s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("x")})
				}
			}
		})
	}
	clock.Advance(time.Millisecond)
	c, err := s.BeginBackup(ctx)
	close(stop)
	wg.Wait()
	require.NoError(t, err)
	m := c.Manifest()
	require.Equal(t, storage.BackupFormat, m.Format)
	require.GreaterOrEqual(t, m.Records, int64(52))
	require.GreaterOrEqual(t, m.Completed, int64(50))
	require.GreaterOrEqual(t, m.TokenHighWater, held.Token)
	copied := copyBackup(t, c, parent)
	require.NoError(t, c.Close())

	// The lost timeline: the held key is taken over, a new key claimed.
	clock.Advance(2 * time.Hour)
	lost := mustAcquire(t, s, claimP(key("taken"), time.Hour, time.Hour))
	lostNew := mustAcquire(t, s, claimP(key("after"), time.Hour, time.Hour))
	var lostHigh int64
	for i := range 20 { // tokens running ahead of the clock on one key
		rec := mustAcquire(t, s, claimP(key(fmt.Sprintf("after-%d", i)), time.Hour, time.Hour))
		lostHigh = max(lostHigh, rec.Token)
	}
	require.NoError(t, s.Close())

	// Without --force the lost timeline's directory is refused.
	_, err = Restore(copied, dataDir, m, RestoreOptions{Logger: testLogger(t)})
	require.ErrorIs(t, err, ErrNotEmpty)

	res, err := Restore(copied, dataDir, m, RestoreOptions{Force: true, Logger: testLogger(t)})
	require.NoError(t, err)
	require.True(t, res.Replaced)
	require.NoError(t, res.ReplacedErr)
	require.Equal(t, max(lostHigh, lostNew.Token, lost.Token), res.ReplacedHighWater)
	require.Greater(t, res.TokenFloor, m.TokenHighWater-1)
	require.GreaterOrEqual(t, res.TokenFloor, res.ReplacedHighWater)
	require.NoDirExists(t, copied)

	// Served again, with the wall clock of today (years behind the
	// store's old clock).
	r := openT(t, dataDir)
	for k, token := range acked {
		got, err := r.Claim(ctx, claimP(key(k), time.Minute, 24*time.Hour))
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeCompleted, got.Outcome, k)
		require.Equal(t, token, got.Record.Token)
		require.Equal(t, []byte(k), got.Record.Result)
	}
	// The lost timeline's holders are refused.
	_, err = r.Complete(ctx, storage.CompleteParams{Key: key("taken"), Token: lost.Token, Result: []byte("lost")})
	require.ErrorIs(t, err, storage.ErrLeaseLost)
	_, err = r.Complete(ctx, storage.CompleteParams{Key: key("after"), Token: lostNew.Token, Result: []byte("lost")})
	require.Error(t, err)
	// The holder from before the backup still holds its lease.
	_, err = r.Extend(ctx, storage.ExtendParams{Key: key("held"), Token: held.Token, Lease: time.Minute})
	require.NoError(t, err)
	// New tokens exceed every earlier one, on a new key, on a key of the
	// lost timeline and on a key with a record.
	for _, k := range []string{"fresh", "after", "after-3", "taken"} {
		got := mustAcquire(t, r, claimP(key(k), time.Minute, time.Hour))
		require.Greater(t, got.Token, res.TokenFloor, k)
		require.Greater(t, got.Token, lostHigh, k)
	}
	inv, err := r.Invalidate(ctx, storage.InvalidateParams{Key: key("before-1"), Reason: "test"})
	require.NoError(t, err)
	require.Greater(t, inv.Token, res.TokenFloor)
}

// TestRestoreRefuses: a copy whose records differ from its manifest, a
// locked data directory; the target is left as it was.
func TestRestoreRefuses(t *testing.T) {
	ctx := t.Context()
	parent := t.TempDir()
	src := openT(t, filepath.Join(parent, "src"))
	rec := mustAcquire(t, src, claimP(key("a"), time.Minute, time.Hour))
	_, err := src.Complete(ctx, storage.CompleteParams{Key: key("a"), Token: rec.Token, Result: []byte("r")})
	require.NoError(t, err)
	c, err := src.BeginBackup(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	m := c.Manifest()
	require.EqualValues(t, 1, m.Records)
	require.EqualValues(t, 1, m.Completed)
	require.Equal(t, rec.Token, m.NewestCompletedToken)

	t.Run("records differ from the manifest", func(t *testing.T) {
		copied := copyBackup(t, c, parent)
		bad := m
		bad.Records = 2
		target := filepath.Join(parent, "t1")
		_, err := Restore(copied, target, bad, RestoreOptions{Logger: testLogger(t)})
		require.ErrorIs(t, err, ErrBackupMismatch)
		require.NoDirExists(t, target)
	})
	t.Run("locked by a serving store", func(t *testing.T) {
		copied := copyBackup(t, c, parent)
		target := filepath.Join(parent, "t2")
		openT(t, target)
		_, err := Restore(copied, target, m, RestoreOptions{Force: true, Logger: testLogger(t)})
		require.ErrorIs(t, err, ErrLocked)
		require.DirExists(t, copied)
	})
	t.Run("stale checkpoints removed at open", func(t *testing.T) {
		dir := filepath.Join(parent, "t3")
		s, err := Open(dir, WithLogger(testLogger(t)))
		require.NoError(t, err)
		c, err := s.BeginBackup(ctx)
		require.NoError(t, err)
		require.NoError(t, s.Close()) // as if the process stopped mid-backup
		_ = c
		s2 := openT(t, dir)
		_ = s2
		matches, err := filepath.Glob(filepath.Join(dir, backupDirPrefix+"*"))
		require.NoError(t, err)
		require.Empty(t, matches)
	})
}
