// Package tmpfs mounts a small real file system for tests that fill a
// disk: a tmpfs of a given size, which a test can grow (remount) to give
// space back. Mounting needs root (CAP_SYS_ADMIN) on Linux; elsewhere, and
// for other users, Mount skips the test with a loud message, except in CI
// (CI set), where it fails, so that the tests that need it cannot go quiet
// there.
package tmpfs

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// FS is a mounted tmpfs.
type FS struct {
	// Dir is where it is mounted.
	Dir string
}

// Mount mounts a tmpfs of size bytes on a new directory under the test's
// temporary directory and unmounts it when the test ends.
func Mount(t testing.TB, size int64) *FS {
	t.Helper()
	if err := canMount(); err != nil {
		msg := fmt.Sprintf("SKIPPED, NOT RUN: this test fills a real file system (a tmpfs it mounts) and cannot mount one: %v. Run it as root on Linux (sudo go test ...)", err)
		if os.Getenv("CI") != "" {
			t.Fatal(msg + "; CI (CI set) must run it")
		}
		t.Skip(msg)
	}
	// Not under t.TempDir(), whose directories only their owner may
	// enter: a PostgreSQL server reaches its tablespace as its own user.
	dir, err := os.MkdirTemp("", "idemreg-tmpfs-")
	if err != nil {
		t.Fatal(err)
	}
	if err := mount(dir, size, false); err != nil {
		_ = os.Remove(dir)
		t.Fatalf("mount a tmpfs of %d bytes on %s: %v", size, dir, err)
	}
	t.Cleanup(func() {
		if err := unmount(dir); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
			return
		}
		_ = os.Remove(dir)
	})
	return &FS{Dir: dir}
}

// Resize changes the file system's size, keeping its files: a larger size
// gives space back to a full file system.
func (f *FS) Resize(t testing.TB, size int64) {
	t.Helper()
	if err := mount(f.Dir, size, true); err != nil {
		t.Fatalf("remount %s with %d bytes: %v", f.Dir, size, err)
	}
}

// Chown gives the file system's root to uid and gid (a PostgreSQL
// tablespace must belong to the server's user).
func (f *FS) Chown(t testing.TB, uid, gid int) {
	t.Helper()
	if err := os.Chown(f.Dir, uid, gid); err != nil {
		t.Fatal(err)
	}
}

// Fill writes a file of zeros named name until the file system is full
// and returns its path: what another writer on a shared file system does.
func (f *FS) Fill(t testing.TB, name string) string {
	t.Helper()
	path := filepath.Join(f.Dir, name)
	file, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	chunk := make([]byte, 64<<10)
	for {
		if _, err := file.Write(chunk); err != nil {
			break // ENOSPC: full
		}
	}
	// The last partial blocks, byte by byte in smaller writes.
	for _, n := range []int{4096, 512, 1} {
		for {
			if _, err := file.Write(chunk[:n]); err != nil {
				break
			}
		}
	}
	return path
}

// Hog fills the file system like Fill, then keeps taking whatever space
// appears (a writer that always wants more), until stop: a store that
// frees files to make room cannot get ahead of it.
func (f *FS) Hog(t testing.TB, name string) (path string, stop func()) {
	t.Helper()
	path = f.Fill(t, name)
	file, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		chunk := make([]byte, 512)
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := file.Write(chunk); err != nil {
				time.Sleep(100 * time.Microsecond)
			}
		}
	})
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(done)
			wg.Wait()
			_ = file.Close()
		})
	}
	t.Cleanup(stop)
	return path, stop
}
