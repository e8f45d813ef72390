package pebble

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Backuper = (*Store)(nil)

// backupDirPrefix names the directories, inside the data directory, that
// hold the checkpoints of backups in progress. They are on the data
// directory's file system, so a checkpoint hard-links the sstables instead
// of copying them. Open removes those a stopped process left behind: a
// hard link keeps the space of an sstable that compactions dropped.
const backupDirPrefix = "backup-"

// checkpointSub is the checkpoint's own directory inside the backup's: the
// name pebble's Checkpoint creates.
const checkpointSub = "store"

// BeginBackup implements storage.Backuper with a pebble checkpoint: a
// consistent view of the database at one point of its WAL, which holds
// every batch committed before it. Whatever a call reported before
// BeginBackup was called is synced (store.go) and so is in the copy; a
// call in flight may or may not be. The checkpoint is read once, to
// describe it (every file's SHA-256, records, newest completion, token
// high-water mark), before it is returned.
func (s *Store) BeginBackup(ctx context.Context) (storage.BackupCopy, error) {
	if _, ok := s.dirLock.(noopCloser); ok {
		return nil, fmt.Errorf("%w: pebble: an in-memory store has no files to back up", storage.ErrUnavailable)
	}
	if err := s.begin(ctx); err != nil {
		return nil, err
	}
	defer s.end()
	created := s.clock()
	dir, err := os.MkdirTemp(s.dir, backupDirPrefix)
	if err != nil {
		return nil, unavailable("create backup directory", err)
	}
	root := filepath.Join(dir, checkpointSub)
	if err := s.guard(func() error { return s.db.Checkpoint(root) }); err != nil {
		_ = os.RemoveAll(dir)
		if errors.Is(err, storage.ErrFailed) {
			return nil, err
		}
		return nil, unavailable("checkpoint", err)
	}
	m, err := describe(ctx, root, created)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, unavailable("describe checkpoint", err)
	}
	s.log.Info("backup checkpoint taken", "dir", dir, "records", m.Records, "bytes", m.Bytes, "files", len(m.Files))
	return &checkpoint{dir: dir, root: root, manifest: m, files: map[string]*os.File{}}, nil
}

// removeStaleBackups removes the checkpoints of backups a stopped process
// left in dir. Open calls it before any backup can begin.
func removeStaleBackups(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("pebble: read %s: %w", dir, err)
	}
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), backupDirPrefix) {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				return fmt.Errorf("pebble: remove a stale backup checkpoint: %w", err)
			}
		}
	}
	return nil
}

// checkpoint is a storage.BackupCopy: a pebble checkpoint in its own
// directory, with its description.
type checkpoint struct {
	dir, root string
	manifest  storage.BackupManifest
	mu        sync.Mutex
	files     map[string]*os.File
	closed    bool
}

func (c *checkpoint) Manifest() storage.BackupManifest { return c.manifest }

// ReadAt reads a file the manifest names, and no other.
func (c *checkpoint) ReadAt(name string, p []byte, off int64) (int, error) {
	if !slices.ContainsFunc(c.manifest.Files, func(f storage.BackupFile) bool { return f.Name == name }) {
		return 0, fmt.Errorf("pebble: %q is not a file of this backup", name)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, errors.New("pebble: the backup's copy was removed")
	}
	f := c.files[name]
	if f == nil {
		var err error
		if f, err = os.Open(filepath.Join(c.root, filepath.FromSlash(name))); err != nil {
			c.mu.Unlock()
			return 0, fmt.Errorf("pebble: open %s of the backup: %w", name, err)
		}
		c.files[name] = f
	}
	c.mu.Unlock()
	return f.ReadAt(p, off)
}

func (c *checkpoint) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	for _, f := range c.files {
		_ = f.Close()
	}
	if err := os.RemoveAll(c.dir); err != nil {
		return fmt.Errorf("pebble: remove the backup's copy: %w", err)
	}
	return nil
}

// describe hashes the files of the store copy in root, then reads it to
// count what it holds.
func describe(ctx context.Context, root string, created time.Time) (storage.BackupManifest, error) {
	m := storage.BackupManifest{Format: storage.BackupFormat, CreatedAt: created}
	entries, err := os.ReadDir(root)
	if err != nil {
		return m, err
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			return m, fmt.Errorf("%s: not a regular file in a checkpoint", e.Name())
		}
		if err := ctx.Err(); err != nil {
			return m, err
		}
		f, err := hashFile(filepath.Join(root, e.Name()))
		if err != nil {
			return m, err
		}
		f.Name = e.Name()
		m.Files = append(m.Files, f)
		m.Bytes += f.Size
	}
	st, err := scanStore(root)
	if err != nil {
		return m, err
	}
	m.Layout = int(st.layout)
	m.Records, m.Completed = st.records, st.completed
	m.NewestCompletedAt, m.NewestCompletedToken = st.newestCompletedAt, st.newestCompletedToken
	m.TokenHighWater = st.highWater
	return m, nil
}

func hashFile(path string) (storage.BackupFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return storage.BackupFile{}, err
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return storage.BackupFile{}, err
	}
	return storage.BackupFile{Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// storeStats is what scanStore read.
type storeStats struct {
	layout               byte
	records, completed   int64
	newestCompletedAt    time.Time
	newestCompletedToken int64
	// highWater is the greatest token of a record (or of an ended
	// attempt in its history) and of the token and restore floors.
	highWater int64
}

// scanStore opens the store in dir read-only, without its lock (the
// caller either made dir or holds its lock), and reads every record's
// metadata once.
func scanStore(dir string) (storeStats, error) {
	var st storeStats
	db, err := pebble.Open(dir, &pebble.Options{ReadOnly: true, Logger: quietLogger{}})
	if err != nil {
		return st, fmt.Errorf("open %s read-only: %w", dir, err)
	}
	defer func() { _ = db.Close() }()
	v, closer, err := db.Get(metaFormat)
	if err != nil {
		return st, fmt.Errorf("%s: no idemreg layout version: %w", dir, err)
	}
	if len(v) == 1 {
		st.layout = v[0]
	}
	_ = closer.Close()
	if st.layout != layoutVersion && st.layout != layoutVersionV1 {
		return st, fmt.Errorf("%s: unknown layout version %x", dir, v)
	}
	for _, key := range [][]byte{metaTokenFloor, metaRestoreFloor} {
		v, closer, err := db.Get(key)
		switch {
		case err == nil:
			if len(v) == 8 {
				st.highWater = max(st.highWater, int64(binary.BigEndian.Uint64(v)))
			}
			_ = closer.Close()
		case !errors.Is(err, pebble.ErrNotFound):
			return st, err
		}
	}
	it, err := db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixRecord}, UpperBound: []byte{prefixRecord + 1}})
	if err != nil {
		return st, err
	}
	defer func() { _ = it.Close() }()
	var rec storage.Record
	for ok := it.First(); ok; ok = it.Next() {
		v, err := it.ValueAndErr()
		if err != nil {
			return st, err
		}
		rec = storage.Record{}
		if err := decodeRecordMeta(v, &rec); err != nil {
			return st, fmt.Errorf("record %x: %w", it.Key(), err)
		}
		st.records++
		st.highWater = max(st.highWater, rec.Token)
		for _, a := range rec.History {
			st.highWater = max(st.highWater, a.Token)
		}
		if rec.State == storage.StateCompleted {
			st.completed++
			if rec.CompletedAt.After(st.newestCompletedAt) {
				st.newestCompletedAt, st.newestCompletedToken = rec.CompletedAt, rec.Token
			}
		}
	}
	return st, it.Error()
}

// quietLogger drops the messages of the read-only opens of scanStore,
// which are not the serving store's.
type quietLogger struct{}

func (quietLogger) Infof(string, ...any)  {}
func (quietLogger) Errorf(string, ...any) {}
func (quietLogger) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
