package pebble

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/tmpfs"
	"github.com/idemreg/idemreg/storage"
)

// resultOf is a result of n incompressible bytes that only name gives, so
// that a test can check a stored result without keeping it.
func resultOf(name string, n int) []byte {
	h := fnv.New64a()
	_, _ = io.WriteString(h, name)
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], h.Sum64())
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(seed).Read(b)
	return b
}

func freeBytes(t testing.TB, dir string) int64 {
	t.Helper()
	u, err := vfs.Default.GetDiskUsage(dir)
	require.NoError(t, err)
	return int64(u.AvailBytes)
}

// TestDiskReserveOnTmpfs fills the store on a real 64 MiB file system
// with 256 KiB results: below the reserve it refuses new keys with
// ErrExhausted (disk) before the file system is full, reads and replays
// go on, the held keys extend, release and complete (large results are
// refused only below half the reserve, small ones never), and once the
// file system grows new keys are accepted again. Every acknowledged
// result is there after a reopen.
func TestDiskReserveOnTmpfs(t *testing.T) {
	fs := tmpfs.Mount(t, 64<<20)
	dir := filepath.Join(fs.Dir, "data")
	const reserve, large = 16 << 20, 256 << 10
	ctx := t.Context()
	s, err := Open(dir, WithLogger(testLogger(t)), WithDiskReserve(reserve), WithDiskCheckInterval(20*time.Millisecond))
	require.NoError(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = s.Close()
		}
	})

	held := make([]storage.Record, 96)
	for i := range held {
		held[i] = mustAcquire(t, s, claimP(key(fmt.Sprintf("held-%d", i)), time.Hour, time.Hour))
	}
	acked := map[string][]byte{} // key → result acknowledged
	var refused error
	for i := 0; ; i++ {
		require.Less(t, i, 1000, "the store never refused a new key on a 64 MiB file system")
		k := key(fmt.Sprintf("fill-%d", i))
		res, err := s.Claim(ctx, claimP(k, time.Hour, time.Hour))
		if err != nil {
			refused = err
			break
		}
		r := resultOf(k.Key, large)
		_, err = s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: r})
		require.NoError(t, err, "a Complete above the reserve")
		acked[k.Key] = r
	}
	t.Logf("%d keys of %d KiB acknowledged before the first refusal; %d bytes free", len(acked), large>>10, freeBytes(t, dir))
	require.ErrorIs(t, refused, storage.ErrExhausted)
	var ex *storage.ExhaustedError
	require.ErrorAs(t, refused, &ex)
	require.Equal(t, storage.ResourceDisk, ex.Resource)
	require.Greater(t, freeBytes(t, dir), int64(reserve/4), "the reserve kept the file system from filling")
	require.Greater(t, len(acked), 40, "refused long before the reserve")

	// A flush deletes the WAL it came from, which can lift the free space
	// back over the reserve for a while: shrink the file system to keep
	// it below (10 MiB free, and a WAL's 4.4 MiB more stays under 16).
	u, err := vfs.Default.GetDiskUsage(dir)
	require.NoError(t, err)
	fs.Resize(t, int64(u.UsedBytes)+10<<20)
	// Measure now rather than wait for the watcher's next tick: the free
	// space it last measured may be from just before the resize, with a
	// flushed WAL's bytes back (CI saw a Claim below pass for that).
	require.NoError(t, s.disk.measure())

	// Reads and replays go on.
	for name, want := range acked {
		res, err := s.Claim(ctx, claimP(key(name), time.Hour, time.Hour))
		require.NoError(t, err)
		require.Equal(t, storage.OutcomeCompleted, res.Outcome)
		require.Equal(t, want, res.Record.Result)
		break
	}
	res, err := s.Claim(ctx, claimP(held[0].Key, time.Hour, time.Hour))
	require.NoError(t, err, "a Claim of a held key answers in progress")
	require.Equal(t, storage.OutcomeInProgress, res.Outcome)

	// Held keys: an Extend, a Release, then Completes with large results
	// until they are refused (below half the reserve), then small ones.
	_, err = s.Extend(ctx, storage.ExtendParams{Key: held[1].Key, Token: held[1].Token, Lease: 2 * time.Hour})
	require.NoError(t, err, "Extend below the reserve")
	_, err = s.Release(ctx, storage.ReleaseParams{Key: held[2].Key, Token: held[2].Token})
	require.NoError(t, err, "Release below the reserve")
	_, err = s.Claim(ctx, claimP(held[2].Key, time.Hour, time.Hour))
	require.ErrorIs(t, err, storage.ErrExhausted, "taking a released key again starts an attempt")
	small := map[string][]byte{}
	largeRefused := 0
	for _, h := range held[3:] {
		r := resultOf(h.Key.Key, large)
		if largeRefused == 0 {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: h.Key, Token: h.Token, Result: r})
			if err == nil {
				acked[h.Key.Key] = r
				continue
			}
			require.ErrorIs(t, err, storage.ErrExhausted, "a large result below half the reserve")
			largeRefused++
			t.Logf("a large result refused with %d bytes free: %v", freeBytes(t, dir), err)
		}
		r = resultOf(h.Key.Key, 512)
		_, err := s.Complete(ctx, storage.CompleteParams{Key: h.Key, Token: h.Token, Result: r})
		require.NoError(t, err, "a small result of a held key completes however little is free")
		small[h.Key.Key] = r
	}
	require.Equal(t, 1, largeRefused, "large results were refused before the held keys ran out")
	require.NotEmpty(t, small)

	// Space comes back: new keys are accepted again.
	fs.Resize(t, 256<<20)
	k := key("after-resize")
	require.Eventually(t, func() bool {
		res, err = s.Claim(ctx, claimP(k, time.Hour, time.Hour))
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "new keys accepted once the file system grew")
	r := resultOf(k.Key, large)
	_, err = s.Complete(ctx, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: r})
	require.NoError(t, err)
	acked[k.Key] = r

	// Nothing acknowledged is lost.
	require.NoError(t, s.Close())
	closed = true
	s = openT(t, dir, WithDiskReserve(reserve))
	for name, want := range acked {
		rec, err := s.Lookup(ctx, key(name))
		require.NoError(t, err, name)
		require.Equal(t, storage.StateCompleted, rec.State, name)
		require.Equal(t, want, rec.Result, name)
	}
	for name, want := range small {
		rec, err := s.Lookup(ctx, key(name))
		require.NoError(t, err, name)
		require.Equal(t, want, rec.Result, name)
	}
	rec, err := s.Lookup(ctx, held[1].Key)
	require.NoError(t, err)
	require.Equal(t, storage.StateInProgress, rec.State, "the extended key is still held")
}

const envFatalDir = "IDEMREG_PEBBLE_TEST_FATAL_DIR"

// TestFatalChild is the process TestFatalOnFullDisk runs: it fills the
// file system from outside the store (another writer), checks that large
// results are refused, then extends a held key until pebble's WAL write
// fails, and checks what the failed store answers. It prints every
// acknowledged write.
func TestFatalChild(t *testing.T) {
	dir := os.Getenv(envFatalDir)
	if dir == "" {
		t.Skip("runs as the child of TestFatalOnFullDisk")
	}
	ctx := context.Background()
	s, err := Open(filepath.Join(dir, "data"), WithLogger(testLogger(t)), WithDiskCheckInterval(10*time.Millisecond))
	require.NoError(t, err)
	for i := range 10 {
		k := key(fmt.Sprintf("done-%d", i))
		rec := mustAcquire(t, s, claimP(k, time.Hour, time.Hour))
		mustComplete(t, s, k, rec.Token, string(resultOf(k.Key, 64<<10)))
		fmt.Printf("ack complete %s %d\n", k.Key, 64<<10)
	}
	held := make([]storage.Record, 3)
	for i := range held {
		held[i] = mustAcquire(t, s, claimP(key(fmt.Sprintf("held-%d", i)), time.Hour, time.Hour))
		fmt.Printf("ack claim %s %d\n", held[i].Key.Key, held[i].Token)
	}

	filler := (&tmpfs.FS{Dir: dir}).Fill(t, "filler")
	fmt.Printf("filled %s\n", filler)
	require.Eventually(t, func() bool { return s.disk.levelOf(s.disk.free.Load()) == diskCritical },
		5*time.Second, 10*time.Millisecond, "the full file system was not measured")
	_, err = s.Complete(ctx, storage.CompleteParams{Key: held[0].Key, Token: held[0].Token, Result: resultOf("x", 1<<20)})
	require.ErrorIs(t, err, storage.ErrExhausted, "a large result on a full file system, before the WAL fails")
	mustComplete(t, s, held[0].Key, held[0].Token, "small")
	fmt.Printf("ack complete %s %d\n", held[0].Key.Key, 5)

	// Extends write a few hundred bytes each into the WAL pebble
	// preallocated; past it, the write fails and pebble calls Fatalf.
	var fatal error
	for i := 0; i < 500_000 && fatal == nil; i++ {
		_, fatal = s.Extend(ctx, storage.ExtendParams{Key: held[1].Key, Token: held[1].Token, Lease: time.Hour + time.Duration(i)*time.Microsecond})
	}
	require.Error(t, fatal, "the WAL never failed on a full file system")
	t.Logf("the store failed: %v", fatal)
	require.ErrorIs(t, fatal, storage.ErrUnavailable)
	require.ErrorIs(t, fatal, storage.ErrFailed)
	select {
	case <-s.Failed():
	default:
		t.Fatal("Failed is not closed")
	}
	require.ErrorIs(t, s.Failure(), storage.ErrFailed)
	_, err = s.Lookup(ctx, held[2].Key)
	require.ErrorIs(t, err, storage.ErrFailed, "reads too: the memtable may hold a write that was never synced")
	require.ErrorIs(t, s.Ping(ctx), storage.ErrUnavailable)
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close of a failed store did not return")
	}
	fmt.Println("failed as expected")
}

// TestFatalOnFullDisk runs TestFatalChild on a 64 MiB tmpfs, then frees
// the space its filler took, reopens the store (a new process, as serve's
// supervisor would start) and checks everything the child acknowledged.
func TestFatalOnFullDisk(t *testing.T) {
	fs := tmpfs.Mount(t, 64<<20)
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestFatalChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), envFatalDir+"="+fs.Dir)
	cmd.Stderr = t.Output()
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	type ack struct {
		op   string
		size int
	}
	acks := map[string]ack{}
	failed := false
	lines := bufio.NewScanner(stdout)
	for lines.Scan() {
		line := lines.Text()
		t.Log("child: " + line)
		var a ack
		var k string
		if n, _ := fmt.Sscanf(line, "ack %s %s %d", &a.op, &k, &a.size); n == 3 {
			acks[k] = a
		}
		failed = failed || strings.HasPrefix(line, "failed as expected")
	}
	require.NoError(t, cmd.Wait(), "the child failed")
	require.True(t, failed, "the child did not reach the store's failure")

	// Still full: Open refuses at once with ENOSPC (serve then exits 75
	// saying the file system is full), rather than retry its flush for
	// ever.
	_, err = Open(filepath.Join(fs.Dir, "data"), WithLogger(testLogger(t)))
	require.ErrorIs(t, err, syscall.ENOSPC)
	t.Logf("Open on the full file system: %v", err)
	require.NoError(t, os.Remove(filepath.Join(fs.Dir, "filler")))
	s := openT(t, filepath.Join(fs.Dir, "data"))
	ctx := t.Context()
	for k, a := range acks {
		rec, err := s.Lookup(ctx, key(k))
		require.NoError(t, err, k)
		switch {
		case a.op == "complete" && a.size == 5:
			require.Equal(t, "small", string(rec.Result), k)
		case a.op == "complete":
			require.Equal(t, resultOf(k, a.size), rec.Result, k)
		default:
			require.Equal(t, storage.StateInProgress, rec.State, k)
			require.Equal(t, int64(a.size), rec.Token, k)
		}
	}
	require.Len(t, acks, 13)
	rec := mustAcquire(t, s, claimP(key("after"), time.Hour, time.Hour))
	mustComplete(t, s, key("after"), rec.Token, "after")
}
