package pebble

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/idemreg/idemreg/storage"
)

// ErrLocked is returned by Open when another Store, in this process or
// another, has the data directory open.
var ErrLocked = errors.New("pebble: data directory is locked")

// errClosed answers calls made after Close.
var errClosed = fmt.Errorf("%w: store is closed", storage.ErrUnavailable)

// Option configures Open.
type Option func(*config)

type config struct {
	now       func() time.Time
	logger    *slog.Logger
	inMemory  bool
	cacheSize int64
	fs        vfs.FS
}

// DefaultCacheSize is the default size of pebble's block cache. Claims of
// new keys look for records that are not there, which reads blocks of every
// level; the cache keeps those reads off the disk for the recent records.
const DefaultCacheSize = 64 << 20

// WithClock sets the store's clock. The default is time.Now.
func WithClock(now func() time.Time) Option { return func(c *config) { c.now = now } }

// WithLogger sets the logger for pebble's own messages and background
// errors. The default is slog.Default().
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithInMemory keeps everything in memory: nothing is written to dir and
// nothing survives Close. For users' unit tests.
func WithInMemory() Option { return func(c *config) { c.inMemory = true } }

// WithCacheSize sets the size in bytes of the block cache. The default is
// DefaultCacheSize.
func WithCacheSize(bytes int64) Option { return func(c *config) { c.cacheSize = bytes } }

// withFS runs the store on fs, without the directory lock; tests use it to
// simulate a power loss with a crashable in-memory file system.
func withFS(fs vfs.FS) Option { return func(c *config) { c.fs = fs } }

// stripes is the number of per-key locks. A call holds its key's lock through
// the WAL sync, so two keys that share a stripe wait one sync for each other;
// 4096 stripes keep that rare at hundreds of concurrent callers.
const stripes = 4096

// Store is the embedded durable store. It implements storage.Store and the
// optional capabilities asserted beside their methods.
type Store struct {
	db      *pebble.DB
	dir     string
	now     func() time.Time
	log     *slog.Logger
	dirLock io.Closer

	seed  maphash.Seed
	locks [stripes]sync.Mutex

	// closeMu is held shared by every call and exclusively by Close, so
	// Close waits for the calls in flight and no call reaches a closed db.
	closeMu sync.RWMutex
	closed  bool

	// sweepMu serialises sweeps, which alone write metaTokenFloor.
	sweepMu sync.Mutex
	// floor mirrors metaTokenFloor. It only grows.
	floor atomic.Int64

	// keyMu serialises the writes of metaClaimKey and metaClaimKeys.
	keyMu sync.Mutex

	// afterScan, when set by a test, runs between a sweep's index scan and
	// its re-check under the key locks.
	afterScan func()
}

var (
	_ storage.Store     = (*Store)(nil)
	_ storage.Sweeper   = (*Store)(nil)
	_ storage.ClaimKeys = (*Store)(nil)
	_ storage.Batcher   = (*Store)(nil)
)

// Open opens the store in dir, creating dir if it is missing. It fails with
// ErrLocked when another Store has dir open.
func Open(dir string, opts ...Option) (*Store, error) {
	cfg := config{now: time.Now, logger: slog.Default(), cacheSize: DefaultCacheSize}
	for _, o := range opts {
		o(&cfg)
	}
	var dirLock io.Closer = noopCloser{}
	fs := cfg.fs
	switch {
	case fs != nil:
	case cfg.inMemory:
		fs = vfs.NewMem()
	default:
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("pebble: create data directory: %w", err)
		}
		l, err := lockDir(dir)
		if err != nil {
			return nil, err
		}
		dirLock, fs = l, vfs.Default
	}
	popts := &pebble.Options{
		FS:                 fs,
		FormatMajorVersion: pebble.FormatNewest,
		Logger:             pebbleLogger{cfg.logger},
		EventListener:      eventListener(cfg.logger),
		CacheSize:          cfg.cacheSize,
		// Larger memtables than the default 4 MiB mean fewer flushes and
		// compactions competing with callers for the CPU. Pebble starts
		// small and grows them, so a small store does not pay for them.
		MemTableSize: 32 << 20,
	}
	// Every Claim of a new key is a Get that finds nothing; without a
	// filter it reads a block of every level that may hold the key.
	popts.Levels[0].FilterPolicy = bloom.FilterPolicy(10)
	db, err := pebble.Open(dir, popts)
	if err != nil {
		_ = dirLock.Close()
		return nil, fmt.Errorf("pebble: open %s: %w", dir, err)
	}
	s := &Store{db: db, dir: dir, now: cfg.now, log: cfg.logger, dirLock: dirLock, seed: maphash.MakeSeed()}
	if err := s.init(); err != nil {
		_ = db.Close()
		_ = dirLock.Close()
		return nil, err
	}
	return s, nil
}

// init checks the layout version, stamping it on a new directory and
// migrating an older one, and loads the token floor.
func (s *Store) init() error {
	v, closer, err := s.db.Get(metaFormat)
	switch {
	case err == nil:
		version := byte(0)
		if len(v) == 1 {
			version = v[0]
		}
		_ = closer.Close()
		switch version {
		case layoutVersion:
		case layoutVersionV1:
			if err := s.migrateV1(); err != nil {
				return err
			}
		default:
			return fmt.Errorf("pebble: %s has an unknown layout version %x (this build writes %d)", s.dir, v, layoutVersion)
		}
	case errors.Is(err, pebble.ErrNotFound):
		empty, err := s.empty()
		if err != nil {
			return err
		}
		if !empty {
			return fmt.Errorf("pebble: %s holds a pebble database that is not an idemreg store", s.dir)
		}
		if err := s.db.Set(metaFormat, []byte{layoutVersion}, pebble.Sync); err != nil {
			return fmt.Errorf("pebble: stamp layout version: %w", err)
		}
	default:
		return fmt.Errorf("pebble: read layout version: %w", err)
	}

	v, closer, err = s.db.Get(metaTokenFloor)
	switch {
	case err == nil:
		if len(v) != 8 {
			_ = closer.Close()
			return fmt.Errorf("pebble: malformed token floor %x", v)
		}
		s.floor.Store(int64(binary.BigEndian.Uint64(v)))
		_ = closer.Close()
	case !errors.Is(err, pebble.ErrNotFound):
		return fmt.Errorf("pebble: read token floor: %w", err)
	}
	return nil
}

// migrateV1 builds the parked index of a version 1 directory, which has
// none, and stamps version 2. It reads every record once, at Open, before
// any call: nothing else writes meanwhile. The entries go in batches of
// migrateBatch and the stamp in the last, synced one, so a crash midway
// leaves version 1 and the next Open starts over (the entries it wrote
// again are the same).
func (s *Store) migrateV1() error {
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixRecord}, UpperBound: []byte{prefixRecord + 1}})
	if err != nil {
		return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
	}
	defer func() { _ = it.Close() }()
	b := s.db.NewBatch()
	defer func() { _ = b.Close() }()
	parked, undecodable := 0, 0
	var rec storage.Record
	for ok := it.First(); ok; ok = it.Next() {
		v, err := it.ValueAndErr()
		if err != nil {
			return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
		}
		if err := decodeRecordMeta(v, &rec); err != nil {
			// Every call on this key fails on it anyway (read); failing
			// Open would take every other key down with it.
			s.log.Error("undecodable record", "key", fmt.Sprintf("%x", it.Key()), "err", err)
			undecodable++
			continue
		}
		if rec.State != storage.StateParked {
			continue
		}
		if err := b.Set(appendParkedKey(nil, it.Key()), appendParkedValue(nil, rec.ExpiresAt), nil); err != nil {
			return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
		}
		if parked++; parked%migrateBatch == 0 {
			if err := b.Commit(pebble.NoSync); err != nil {
				return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
			}
			_ = b.Close()
			b = s.db.NewBatch()
		}
	}
	if err := it.Error(); err != nil {
		return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
	}
	if err := b.Set(metaFormat, []byte{layoutVersion}, nil); err != nil {
		return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
	}
	// Synced: the WAL is written in order, so the earlier, unsynced
	// batches are durable with this one.
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("pebble: migrate %s: %w", s.dir, err)
	}
	s.log.Info("pebble layout migrated", "dir", s.dir, "from", layoutVersionV1, "to", layoutVersion, "parked", parked, "undecodable", undecodable)
	return nil
}

// migrateBatch bounds the entries of one batch of migrateV1.
const migrateBatch = 10_000

func (s *Store) empty() (bool, error) {
	it, err := s.db.NewIter(nil)
	if err != nil {
		return false, fmt.Errorf("pebble: %w", err)
	}
	empty := !it.First()
	if err := it.Close(); err != nil {
		return false, fmt.Errorf("pebble: %w", err)
	}
	return empty, nil
}

// begin admits a call, holding closeMu shared until end.
func (s *Store) begin(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", storage.ErrUnavailable, err)
	}
	s.closeMu.RLock()
	if s.closed {
		s.closeMu.RUnlock()
		return errClosed
	}
	return nil
}

func (s *Store) end() { s.closeMu.RUnlock() }

// clock reads the store's clock as stored: UTC, whole microseconds.
func (s *Store) clock() time.Time { return truncTime(s.now()) }

func (s *Store) stripe(recordKey []byte) int {
	return int(maphash.Bytes(s.seed, recordKey) % stripes)
}

// lockKey takes the lock of a record key. Every read of a record that leads
// to an answer happens under it: besides keeping decisions on one key from
// interleaving, it keeps readers from seeing a write whose WAL sync has not
// finished (pebble makes a batch visible before its sync completes).
func (s *Store) lockKey(recordKey []byte) *sync.Mutex {
	m := &s.locks[s.stripe(recordKey)]
	m.Lock()
	return m
}

func unavailable(what string, err error) error {
	return fmt.Errorf("%w: pebble: %s: %w", storage.ErrUnavailable, what, err)
}

// read loads the record at recordKey into r and reports whether there is one.
func (s *Store) read(recordKey []byte, r *storage.Record) (bool, error) {
	return s.readWith(s.db, recordKey, r, decodeRecord)
}

// readWith is read from db (the store's, or a snapshot of it), decoding
// with decode.
func (s *Store) readWith(db pebble.Reader, recordKey []byte, r *storage.Record, decode func([]byte, *storage.Record) error) (bool, error) {
	v, closer, err := db.Get(recordKey)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, unavailable("read record", err)
	}
	err = decode(v, r)
	_ = closer.Close()
	if err != nil {
		s.log.Error("undecodable record", "key", fmt.Sprintf("%x", recordKey), "err", err)
		return false, unavailable("decode record", err)
	}
	return true, nil
}

// write stores next in place of prev (nil when there is none) and moves the
// record's index entries, in one batch synced to the WAL before it
// returns.
func (s *Store) write(recordKey []byte, prev, next *storage.Record) error {
	b := s.db.NewBatchWithSize(recordSize(next) + 5*(len(recordKey)+expiryHeader+16))
	defer b.Close()
	if err := addWrite(b, recordKey, prev, next); err != nil {
		return err
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return unavailable("commit", err)
	}
	return nil
}

// addWrite adds to b the write of next in place of prev: the record, the
// move of its expiry index entry and, when it is parked before or after,
// its parked index entry. Writes of one key added in turn to one batch
// apply in turn.
func addWrite(b *pebble.Batch, recordKey []byte, prev, next *storage.Record) error {
	size := recordSize(next)
	op := b.SetDeferred(len(recordKey), size)
	copy(op.Key, recordKey)
	if n := len(appendRecord(op.Value[:0], next)); n != size {
		panic(fmt.Sprintf("pebble: record encoded to %d bytes, sized %d", n, size))
	}
	if err := op.Finish(); err != nil {
		return unavailable("batch", err)
	}
	if prev == nil || !prev.ExpiresAt.Equal(next.ExpiresAt) {
		if prev != nil {
			op = b.DeleteDeferred(expiryHeader + len(recordKey))
			appendExpiryKey(op.Key[:0], prev.ExpiresAt, recordKey)
			if err := op.Finish(); err != nil {
				return unavailable("batch", err)
			}
		}
		op = b.SetDeferred(expiryHeader+len(recordKey), 0)
		appendExpiryKey(op.Key[:0], next.ExpiresAt, recordKey)
		if err := op.Finish(); err != nil {
			return unavailable("batch", err)
		}
	}
	wasParked := prev != nil && prev.State == storage.StateParked
	switch {
	case next.State == storage.StateParked && (!wasParked || !prev.ExpiresAt.Equal(next.ExpiresAt)):
		op = b.SetDeferred(1+len(recordKey), parkedValueSize)
		appendParkedKey(op.Key[:0], recordKey)
		appendParkedValue(op.Value[:0], next.ExpiresAt)
	case next.State != storage.StateParked && wasParked:
		op = b.DeleteDeferred(1 + len(recordKey))
		appendParkedKey(op.Key[:0], recordKey)
	default:
		return nil
	}
	if err := op.Finish(); err != nil {
		return unavailable("batch", err)
	}
	return nil
}

func recordKeyOf(k storage.Key) []byte {
	return appendRecordKey(make([]byte, 0, 8+len(k.Consumer)+len(k.Key)), k)
}

// withRecord runs fn under k's lock with k's stored record, nil when there
// is none, and the encoded record key.
func (s *Store) withRecord(ctx context.Context, k storage.Key, fn func(key []byte, cur *storage.Record) error) error {
	if err := s.begin(ctx); err != nil {
		return err
	}
	defer s.end()
	key := recordKeyOf(k)
	defer s.lockKey(key).Unlock()

	var stored storage.Record
	found, err := s.read(key, &stored)
	if err != nil {
		return err
	}
	if !found {
		return fn(key, nil)
	}
	stored.Key = k
	return fn(key, &stored)
}

// Claim decides by storage.DecideClaim under the key's lock.
func (s *Store) Claim(ctx context.Context, p storage.ClaimParams) (res storage.ClaimResult, err error) {
	err = s.withRecord(ctx, p.Key, func(key []byte, prev *storage.Record) error {
		cur := prev
		if prev == nil {
			if floor := s.floor.Load(); floor > 0 {
				// The key may have had a record the sweeper deleted; its
				// tokens were at most the floor. Present it to DecideClaim
				// as the expired record it was, so the new token exceeds
				// them however the clock moved since.
				cur = &storage.Record{Key: p.Key, Token: floor}
			}
		}
		var write bool
		res, write, err = storage.DecideClaim(s.clock(), cur, p)
		if err != nil || !write {
			return err
		}
		normalize(&res.Record)
		return s.write(key, prev, &res.Record)
	})
	if err != nil {
		return storage.ClaimResult{}, err
	}
	res.Record.History = nil
	return res, nil
}

// update runs a fenced decision on k under its lock and stores what it
// decides to write. The answer is without History, which only Inspect and
// List return.
func (s *Store) update(ctx context.Context, k storage.Key, decide func(now time.Time, cur *storage.Record) (storage.Record, bool, error)) (rec storage.Record, err error) {
	err = s.withRecord(ctx, k, func(key []byte, cur *storage.Record) error {
		var write bool
		rec, write, err = decide(s.clock(), cur)
		if err != nil || !write {
			return err
		}
		normalize(&rec)
		return s.write(key, cur, &rec)
	})
	if err != nil {
		return storage.Record{}, err
	}
	rec.History = nil
	return rec, nil
}

// Complete decides by storage.DecideComplete under the key's lock.
func (s *Store) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideComplete(now, cur, p)
	})
}

// Release decides by storage.DecideRelease under the key's lock.
func (s *Store) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideRelease(now, cur, p)
	})
}

// Extend decides by storage.DecideExtend under the key's lock.
func (s *Store) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecideExtend(now, cur, p)
	})
}

// Park decides by storage.DecidePark under the key's lock.
func (s *Store) Park(ctx context.Context, p storage.ParkParams) (storage.Record, error) {
	return s.update(ctx, p.Key, func(now time.Time, cur *storage.Record) (storage.Record, bool, error) {
		return storage.DecidePark(now, cur, p)
	})
}

// Lookup decides by storage.DecideLookup under the key's lock.
func (s *Store) Lookup(ctx context.Context, k storage.Key) (rec storage.Record, err error) {
	err = s.withRecord(ctx, k, func(_ []byte, cur *storage.Record) error {
		rec, err = storage.DecideLookup(s.clock(), cur)
		return err
	})
	rec.History = nil
	return rec, err
}

// Ping returns nil while the store is open.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.begin(ctx); err != nil {
		return err
	}
	s.end()
	return nil
}

// Close waits for calls in flight, closes pebble and releases the directory
// lock. Calls after Close fail with storage.ErrUnavailable.
func (s *Store) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	if err := s.db.Close(); err != nil {
		errs = append(errs, fmt.Errorf("pebble: close: %w", err))
	}
	if err := s.dirLock.Close(); err != nil {
		errs = append(errs, fmt.Errorf("pebble: release lock: %w", err))
	}
	return errors.Join(errs...)
}

type noopCloser struct{}

func (noopCloser) Close() error { return nil }

// pebbleLogger sends pebble's messages to slog.
type pebbleLogger struct{ l *slog.Logger }

func (p pebbleLogger) Infof(format string, args ...any) {
	p.l.Info("pebble", "detail", fmt.Sprintf(format, args...))
}

func (p pebbleLogger) Errorf(format string, args ...any) {
	p.l.Error("pebble error", "detail", fmt.Sprintf(format, args...))
}

// Fatalf must not return: pebble calls it when its state can no longer be
// trusted (a failed commit leaves the WAL in an unknown state).
func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	p.l.Error("pebble fatal error", "detail", msg)
	panic("pebble: " + msg)
}

func eventListener(l *slog.Logger) *pebble.EventListener {
	return &pebble.EventListener{
		BackgroundError: func(err error) { l.Error("pebble background error", "err", err) },
		DataCorruption: func(info pebble.DataCorruptionInfo) {
			l.Error("pebble data corruption", "path", info.Path, "err", info.Details)
		},
		DiskSlow: func(info pebble.DiskSlowInfo) {
			l.Warn("pebble disk slow", "path", info.Path, "duration", info.Duration)
		},
		WriteStallBegin: func(info pebble.WriteStallBeginInfo) {
			l.Warn("pebble write stall", "reason", info.Reason)
		},
	}
}
