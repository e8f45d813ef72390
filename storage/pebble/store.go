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
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
	"github.com/cockroachdb/pebble/v2/vfs"
	"go.opentelemetry.io/otel/metric"

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
	meters    metric.MeterProvider
	// diskReserve and diskInterval: WithDiskReserve, WithDiskCheckInterval.
	diskReserve  int64
	diskInterval time.Duration
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

// WithDiskReserve sets the free space of the data directory's file system
// below which the store refuses Claims that would start an attempt (and,
// below half of it, results over LargeResultBytes) with a
// *storage.ExhaustedError; see DefaultDiskReserve for why it is what it
// is. Zero means DefaultDiskReserve, a negative value no reserve.
func WithDiskReserve(bytes int64) Option { return func(c *config) { c.diskReserve = bytes } }

// WithDiskCheckInterval sets how often the free space is measured
// (DefaultDiskCheckInterval when zero).
func WithDiskCheckInterval(d time.Duration) Option { return func(c *config) { c.diskInterval = d } }

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

	// disk keeps the data directory's free space (disk.go); nil when
	// nothing is refused for it.
	disk *diskWatch
	// failure is set by pebble's fatal error (disk.go).
	failure *failure
	// stop ends the disk watch and the instruments' registration.
	stop func()

	// members is the membership (membership.go).
	members members

	// clockFloor is the restore floor's next microsecond (restore.go):
	// the clock never reads earlier. Zero when never restored.
	clockFloor time.Time
}

var (
	_ storage.Store        = (*Store)(nil)
	_ storage.Sweeper      = (*Store)(nil)
	_ storage.ClaimKeys    = (*Store)(nil)
	_ storage.Batcher      = (*Store)(nil)
	_ storage.MixedBatcher = (*Store)(nil)
)

// Open opens the store in dir, creating dir if it is missing. It fails with
// ErrLocked when another Store has dir open.
func Open(dir string, opts ...Option) (*Store, error) {
	cfg := config{now: time.Now, logger: slog.Default(), cacheSize: DefaultCacheSize}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.diskInterval <= 0 {
		cfg.diskInterval = DefaultDiskCheckInterval
	}
	fail := newFailure(cfg.logger)
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
		if err := removeStaleBackups(dir); err != nil {
			_ = l.Close()
			return nil, err
		}
		dirLock, fs = l, vfs.Default
	}
	// Sized to the file system: on a small one a memtable of 32 MiB, and
	// the WAL pebble preallocates for it (110%), would take most of it.
	memTable := uint64(32 << 20)
	var fsTotal int64
	if fs == vfs.Default {
		u, err := fs.GetDiskUsage(dir)
		if err != nil {
			_ = dirLock.Close()
			return nil, fmt.Errorf("pebble: measure free space of %s: %w", dir, err)
		}
		fsTotal = int64(min(u.TotalBytes, 1<<62))
		memTable = min(memTable, max(4<<20, u.TotalBytes/32))
		if u.AvailBytes < memTable {
			// Opening replays the WAL into a flush and starts a new WAL;
			// on a file system without room for them pebble retries the
			// flush for ever (seen on a full tmpfs), so say why at once.
			_ = dirLock.Close()
			return nil, fmt.Errorf("pebble: %s has %d bytes free, less than the %d the store needs to open (its WAL's replay and a new WAL): %w",
				dir, u.AvailBytes, memTable, syscall.ENOSPC)
		}
	}
	if cfg.diskReserve == 0 {
		cfg.diskReserve = DefaultDiskReserve
		if fsTotal > 0 {
			cfg.diskReserve = min(cfg.diskReserve, fsTotal/4)
		}
	}
	popts := &pebble.Options{
		FS:                 fs,
		FormatMajorVersion: pebble.FormatNewest,
		Logger:             pebbleLogger{cfg.logger, fail},
		EventListener:      eventListener(cfg.logger),
		CacheSize:          cfg.cacheSize,
		// Larger memtables than the default 4 MiB mean fewer flushes and
		// compactions competing with callers for the CPU. Pebble starts
		// small and grows them, so a small store does not pay for them.
		MemTableSize: memTable,
	}
	// Every Claim of a new key is a Get that finds nothing; without a
	// filter it reads a block of every level that may hold the key.
	popts.Levels[0].FilterPolicy = bloom.FilterPolicy(10)
	db, err := pebble.Open(dir, popts)
	if err != nil {
		_ = dirLock.Close()
		return nil, fmt.Errorf("pebble: open %s: %w", dir, err)
	}
	s := &Store{db: db, dir: dir, now: cfg.now, log: cfg.logger, dirLock: dirLock, seed: maphash.MakeSeed(), failure: fail, stop: func() {}}
	if fs == vfs.Default && cfg.diskReserve > 0 {
		s.disk = &diskWatch{dir: dir, fs: fs, reserve: cfg.diskReserve, log: cfg.logger,
			size: func() uint64 { return db.Metrics().DiskSpaceUsage() }}
		if err := s.disk.measure(); err != nil {
			_ = db.Close()
			_ = dirLock.Close()
			return nil, err
		}
	}
	if err := s.init(); err != nil {
		_ = db.Close()
		_ = dirLock.Close()
		return nil, err
	}
	reg, err := s.instrument(cfg.meters)
	if err != nil {
		_ = db.Close()
		_ = dirLock.Close()
		return nil, fmt.Errorf("pebble: instruments: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var watch sync.WaitGroup
	if s.disk != nil {
		watch.Go(func() { s.disk.run(ctx, cfg.diskInterval) })
	}
	s.stop = func() { cancel(); watch.Wait(); _ = reg.Unregister() }
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
		if err := s.guard(func() error { return s.db.Set(metaFormat, []byte{layoutVersion}, pebble.Sync) }); err != nil {
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
	return s.loadRestoreFloor()
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
			if err := s.guard(func() error { return b.Commit(pebble.NoSync) }); err != nil {
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
	if err := s.guard(func() error { return b.Commit(pebble.Sync) }); err != nil {
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
	if s.failure.failed() {
		return s.failure.answer()
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
// It never reads below clockFloor, so that a restored store issues tokens
// above every token of the timelines before the restore.
func (s *Store) clock() time.Time { return maxTime(truncTime(s.now()), s.clockFloor) }

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

// unavailable is the answer to a failure of pebble: ErrUnavailable, or
// ErrExhausted when a resource ran short (exhausted).
func unavailable(what string, err error) error {
	if ex := exhausted(what, err); ex != nil {
		return ex
	}
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
	return s.commit(b, pebble.Sync)
}

// set writes one meta key, synced.
func (s *Store) set(key, value []byte, what string) error {
	err := s.guard(func() error { return s.db.Set(key, value, pebble.Sync) })
	switch {
	case err == nil:
		s.disk.wrote(len(key) + len(value))
		return nil
	case errors.Is(err, storage.ErrFailed):
		return err
	default:
		return unavailable(what, err)
	}
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
		if res.Outcome == storage.OutcomeAcquired {
			// A new key or a takeover: new work, and the record of a
			// new key, which is the growth the reserve refuses.
			if err := s.disk.refuseAttempt(); err != nil {
				return err
			}
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
		rec, write, err := storage.DecideComplete(now, cur, p)
		if err == nil && write {
			if err := s.disk.refuseResult(len(p.Result)); err != nil {
				return storage.Record{}, false, err
			}
		}
		return rec, write, err
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
	s.stop()
	if s.failure.failed() {
		// Pebble cannot be closed after its fatal error (its commit
		// pipeline may hold callers for good, and closing would wait for
		// them): the process is about to exit, which releases the rest.
		if err := s.dirLock.Close(); err != nil {
			return fmt.Errorf("pebble: release lock: %w", err)
		}
		return nil
	}
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

// pebbleLogger sends pebble's messages to slog, and its fatal errors to
// the store's failure.
type pebbleLogger struct {
	l    *slog.Logger
	fail *failure
}

func (p pebbleLogger) Infof(format string, args ...any) {
	p.l.Info("pebble", "detail", fmt.Sprintf(format, args...))
}

func (p pebbleLogger) Errorf(format string, args ...any) {
	p.l.Error("pebble error", "detail", fmt.Sprintf(format, args...))
}

// Fatalf must not return: pebble calls it when its state can no longer be
// trusted (a failed commit leaves the WAL in an unknown state). The store
// fails for good (disk.go's failure). On a goroutine that is answering a
// call (inside guard) it panics for guard to recover, so that the caller
// gets UNAVAILABLE; on one of pebble's own (a flush's MANIFEST write) it
// parks that goroutine for good rather than crash the process before the
// server has turned NOT_SERVING and said why: the server stops and exits
// on the store's failure (server.ErrStoreFailed).
func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	p.l.Error("pebble fatal error", "detail", msg)
	err := errors.New(msg)
	if !strings.HasPrefix(msg, "pebble") {
		err = errors.New("pebble: " + msg)
	}
	p.fail.fail(err)
	if inGuard() {
		panic(fatalPanic{err})
	}
	select {}
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
