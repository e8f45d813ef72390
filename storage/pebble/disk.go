package pebble

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/storage"
)

// The data directory's reserve. Below it the store refuses what would
// grow it for good, so that what is left serves what must not fail: the
// Completes, Releases and Extends of keys already held (each a record
// rewritten), and Pebble's own work, which needs room to write before it
// frees any. A memtable flush writes its tables (up to MemTableSize, 32
// MiB) while the WAL they come from is still on disk, and a compaction
// writes its output before it deletes its inputs; the sweeper's deletes
// free space only through those. DefaultDiskReserve is two memtables and a
// compaction's worth above that. It is a margin, not a ballast file: the
// store's own growth is what fills a data directory it has to itself, and
// a margin refuses that growth before the disk is full while costing no
// space in the common case; a ballast guards against other writers on a
// shared file system, which a data directory should not have.
const (
	// DefaultDiskReserve is the free space below which the store refuses
	// new attempts (WithDiskReserve), or a quarter of the file system when
	// that is less: a file system of under 1 GiB also gets a smaller
	// memtable (a 32nd of it, at least 4 MiB), so Pebble needs less.
	DefaultDiskReserve = 256 << 20
	// DefaultDiskCheckInterval is how often the free space is measured;
	// between two measures the store subtracts what it commits.
	DefaultDiskCheckInterval = time.Second
	// LargeResultBytes is the largest result a Complete may store once
	// the free space is below half the reserve: a held key's Complete
	// with a small result (or a failure) still lands there, a large one
	// waits for space (the holder keeps its lease, and may Extend).
	LargeResultBytes = 64 << 10
)

// diskLevel is how short of space the data directory is.
type diskLevel int32

const (
	diskOK diskLevel = iota
	// diskLow: below twice the reserve. Logged and measured (the metric
	// idemreg.store.disk.free against idemreg.store.disk.reserve), so an
	// operator is told before anything is refused.
	diskLow
	// diskRefusing: below the reserve. Claims that would start an
	// attempt (a new key, a takeover) are refused.
	diskRefusing
	// diskCritical: below half the reserve. Results over
	// LargeResultBytes are refused too.
	diskCritical
)

func (l diskLevel) String() string {
	return [...]string{"ok", "low", "refusing", "critical"}[l]
}

// diskWatch keeps the data directory's free space and decides the
// refusals. A nil *diskWatch (an in-memory store, or WithDiskReserve
// negative) refuses nothing.
type diskWatch struct {
	dir     string
	fs      vfs.FS
	reserve int64
	log     *slog.Logger
	// size is the store's size on disk (pebble's DiskSpaceUsage).
	size func() uint64

	// free is the available bytes as last measured, less the bytes
	// committed since; total is the file system's size.
	free, total atomic.Int64
	// level is the level last logged.
	level atomic.Int32
	// logMu keeps the level's log lines in the order of its changes.
	logMu sync.Mutex
}

func (d *diskWatch) levelOf(free int64) diskLevel {
	switch {
	case free < d.reserve/2:
		return diskCritical
	case free < d.reserve:
		return diskRefusing
	case free < 2*d.reserve:
		return diskLow
	}
	return diskOK
}

// measure reads the file system's figures and logs a change of level.
func (d *diskWatch) measure() error {
	u, err := d.fs.GetDiskUsage(d.dir)
	if err != nil {
		return fmt.Errorf("pebble: measure free space of %s: %w", d.dir, err)
	}
	d.free.Store(int64(min(u.AvailBytes, 1<<62)))
	d.total.Store(int64(min(u.TotalBytes, 1<<62)))
	d.note()
	return nil
}

// wrote subtracts n bytes just committed from the free space, until the
// next measure replaces the estimate: a burst of writes between two
// measures cannot run past the reserve unseen.
func (d *diskWatch) wrote(n int) {
	if d == nil {
		return
	}
	d.free.Add(-int64(n))
	if d.levelOf(d.free.Load()) != diskLevel(d.level.Load()) {
		d.note()
	}
}

// note logs the level when it changed: the line an operator alerts on
// before refusals start (low), when they start, and when they end.
func (d *diskWatch) note() {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	free := d.free.Load()
	lvl := d.levelOf(free)
	was := diskLevel(d.level.Swap(int32(lvl)))
	if was == lvl {
		return
	}
	attrs := []any{"dir", d.dir, "free_bytes", free, "store_bytes", d.size(), "reserve_bytes", d.reserve,
		"total_bytes", d.total.Load(), "level", lvl.String(), "was", was.String()}
	switch lvl {
	case diskOK:
		d.log.Info("data directory has free space again", attrs...)
	case diskLow:
		if was < diskLow {
			d.log.Warn("data directory short of space: new keys will be refused below the reserve", attrs...)
		} else {
			d.log.Info("data directory above its reserve again: new keys accepted", attrs...)
		}
	case diskRefusing:
		d.log.Error("data directory below its reserve: refusing Claims that would start an attempt; Completes, Releases, Extends and reads go on", attrs...)
	case diskCritical:
		d.log.Error("data directory below half its reserve: refusing results over the large-result bound too",
			append(attrs, "large_result_bytes", LargeResultBytes)...)
	}
}

// run measures every interval until ctx ends.
func (d *diskWatch) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var failing bool
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := d.measure()
		if err != nil && !failing {
			d.log.Warn("cannot measure the data directory's free space", "dir", d.dir, "error", err)
		}
		failing = err != nil
	}
}

// refuseAttempt is the refusal of a Claim that would start an attempt,
// nil when there is room.
func (d *diskWatch) refuseAttempt() error {
	if d == nil {
		return nil
	}
	if free := d.free.Load(); d.levelOf(free) >= diskRefusing {
		return &storage.ExhaustedError{Resource: storage.ResourceDisk,
			Detail: fmt.Sprintf("new attempt refused: %d bytes free in %s, below the reserve of %d", free, d.dir, d.reserve)}
	}
	return nil
}

// refuseResult is the refusal of a Complete storing n bytes of result,
// nil when there is room.
func (d *diskWatch) refuseResult(n int) error {
	if d == nil || n <= LargeResultBytes {
		return nil
	}
	if free := d.free.Load(); d.levelOf(free) >= diskCritical {
		return &storage.ExhaustedError{Resource: storage.ResourceDisk,
			Detail: fmt.Sprintf("result of %d bytes refused: %d bytes free in %s, below half the reserve of %d", n, free, d.dir, d.reserve)}
	}
	return nil
}

// MeterName is the instrumentation scope of the embedded store's
// instruments.
const MeterName = "github.com/idemreg/idemreg/storage/pebble"

// The embedded store's instruments (Prometheus: idemreg_store_disk_free_bytes,
// and so on).
const (
	// MetricDiskFree is the bytes available on the data directory's file
	// system: alert when it nears MetricDiskReserve.
	MetricDiskFree = "idemreg.store.disk.free"
	// MetricDiskTotal is the file system's size.
	MetricDiskTotal = "idemreg.store.disk.total"
	// MetricDiskReserve is the reserve (WithDiskReserve).
	MetricDiskReserve = "idemreg.store.disk.reserve"
	// MetricSize is the store's files' size (Pebble's DiskSpaceUsage:
	// tables, WAL, manifests, obsolete files not yet deleted).
	MetricSize = "idemreg.store.size"
	// MetricDiskRefusing is 1 while new attempts are refused for lack of
	// space, 2 while large results are too, 0 otherwise.
	MetricDiskRefusing = "idemreg.store.disk.refusing"
	// MetricFailed is 1 once the store failed for good (storage.Failing).
	MetricFailed = "idemreg.store.failed"

	// Pebble's own statistics, read from DB.Metrics once per collection
	// (a copy of counters it keeps anyway, under its lock: cheap beside
	// a scrape interval).

	// MetricMemtableSize is the bytes of the memtables (the one taking
	// writes and those waiting to be flushed); MetricMemtableCount their
	// number. Many waiting memtables mean flushes lag the writes.
	MetricMemtableSize  = "idemreg.store.pebble.memtable.size"
	MetricMemtableCount = "idemreg.store.pebble.memtable.count"
	// MetricFlushes counts the memtable flushes since the store opened.
	MetricFlushes = "idemreg.store.pebble.flushes"
	// MetricCompactions counts the compactions since the store opened;
	// MetricCompactionsRunning is those in progress.
	MetricCompactions        = "idemreg.store.pebble.compactions"
	MetricCompactionsRunning = "idemreg.store.pebble.compactions.running"
	// MetricCompactionDebt is Pebble's estimate of the bytes compactions
	// must rewrite to bring the LSM back into shape: a debt that keeps
	// growing means compactions do not keep up with the writes, and
	// Pebble will stall writes.
	MetricCompactionDebt = "idemreg.store.pebble.compaction.debt"
	// MetricReadAmp is the read amplification: the files (L0 sublevels
	// and non-empty levels) a read may have to look at.
	MetricReadAmp = "idemreg.store.pebble.read_amplification"
)

// WithMeterProvider sets where the store's instruments are made (default:
// otel.GetMeterProvider() when Open runs).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meters = mp }
}

// instrument registers the store's gauges; the registration ends at
// Close.
func (s *Store) instrument(mp metric.MeterProvider) (metric.Registration, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(MeterName)
	var errs []error
	gauge := func(name, unit, desc string) metric.Int64ObservableGauge {
		g, err := m.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	free := gauge(MetricDiskFree, "By", "Bytes available on the embedded store's file system (less what it committed since the last measure).")
	total := gauge(MetricDiskTotal, "By", "Size of the embedded store's file system.")
	reserve := gauge(MetricDiskReserve, "By", "Free space below which the embedded store refuses new attempts (and, below half of it, large results).")
	size := gauge(MetricSize, "By", "Size of the embedded store's files.")
	refusing := gauge(MetricDiskRefusing, "{level}", "1 while the embedded store refuses new attempts for lack of disk space, 2 while it refuses large results too, else 0.")
	failed := gauge(MetricFailed, "{failed}", "1 once the embedded store failed for good and needs a restart.")
	memSize := gauge(MetricMemtableSize, "By", "Bytes of the embedded store's memtables (the one taking writes and those waiting for a flush).")
	memCount := gauge(MetricMemtableCount, "{memtable}", "Memtables of the embedded store (the one taking writes and those waiting for a flush).")
	running := gauge(MetricCompactionsRunning, "{compaction}", "Compactions of the embedded store in progress.")
	debt := gauge(MetricCompactionDebt, "By", "Bytes the embedded store's compactions must rewrite to bring its LSM back into shape (Pebble's estimate); growing without bound, writes will stall.")
	readAmp := gauge(MetricReadAmp, "{file}", "Read amplification of the embedded store: the files (L0 sublevels and non-empty levels) a read may look at.")
	counter := func(name, unit, desc string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	flushes := counter(MetricFlushes, "{flush}", "Memtable flushes of the embedded store since it opened.")
	compactions := counter(MetricCompactions, "{compaction}", "Compactions of the embedded store since it opened.")
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	dirAttr := metric.WithAttributes(attribute.String("dir", s.dir))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		f := int64(0)
		if s.failure.failed() {
			f = 1
		}
		o.ObserveInt64(failed, f, dirAttr)
		if f == 0 {
			pm := s.db.Metrics()
			o.ObserveInt64(memSize, int64(pm.MemTable.Size), dirAttr)
			o.ObserveInt64(memCount, pm.MemTable.Count, dirAttr)
			o.ObserveInt64(flushes, pm.Flush.Count, dirAttr)
			o.ObserveInt64(compactions, pm.Compact.Count, dirAttr)
			o.ObserveInt64(running, pm.Compact.NumInProgress, dirAttr)
			o.ObserveInt64(debt, int64(min(pm.Compact.EstimatedDebt, math.MaxInt64)), dirAttr)
			o.ObserveInt64(readAmp, int64(pm.ReadAmp()), dirAttr)
		}
		if s.disk == nil {
			return nil
		}
		o.ObserveInt64(free, max(s.disk.free.Load(), 0), dirAttr)
		o.ObserveInt64(total, s.disk.total.Load(), dirAttr)
		o.ObserveInt64(reserve, s.disk.reserve, dirAttr)
		if !s.failure.failed() {
			o.ObserveInt64(size, int64(s.disk.size()), dirAttr)
		}
		r := int64(0)
		switch s.disk.levelOf(s.disk.free.Load()) {
		case diskRefusing:
			r = 1
		case diskCritical:
			r = 2
		}
		o.ObserveInt64(refusing, r, dirAttr)
		return nil
	}, free, total, reserve, size, refusing, failed, memSize, memCount, flushes, compactions, running, debt, readAmp)
}

// failure is the store's failure for good: Pebble's fatal error (its
// Logger.Fatalf), after which its write-ahead log is in a state this
// process cannot trust (a batch may be visible that was never synced).
// The store then answers every call with storage.ErrUnavailable wrapping
// storage.ErrFailed without touching Pebble, and the server exits so that
// a new process recovers from what was synced, which is everything the
// store acknowledged: reopening in this process would need Pebble closed
// first, and a DB whose commit pipeline failed cannot be closed safely.
type failure struct {
	log  *slog.Logger
	once sync.Once
	done chan struct{}
	err  error
}

func newFailure(log *slog.Logger) *failure { return &failure{log: log, done: make(chan struct{})} }

func (f *failure) fail(err error) {
	f.once.Do(func() {
		f.err = fmt.Errorf("%w: %w", storage.ErrFailed, err)
		if errors.Is(err, syscall.ENOSPC) || strings.Contains(err.Error(), "no space left on device") {
			f.log.Error("embedded store failed: its file system is full; every call answers UNAVAILABLE until a new process opens it (free space or grow the file system first: the new process refuses new keys until the reserve is free)", "error", err)
		} else {
			f.log.Error("embedded store failed; every call answers UNAVAILABLE until a new process opens it", "error", err)
		}
		close(f.done)
	})
}

func (f *failure) failed() bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

// answer is what a call gets from a failed store.
func (f *failure) answer() error {
	return fmt.Errorf("%w: pebble: %w", storage.ErrUnavailable, f.err)
}

// Failed implements storage.Failing.
func (s *Store) Failed() <-chan struct{} { return s.failure.done }

// Failure implements storage.Failing.
func (s *Store) Failure() error {
	if !s.failure.failed() {
		return nil
	}
	return s.failure.err
}

var _ storage.Failing = (*Store)(nil)

// fatalPanic is what pebbleLogger.Fatalf panics with inside guard, which
// recovers it.
type fatalPanic struct{ err error }

// guardFrame is the function whose frame on a goroutine's stack says that
// a fatal error there can be answered to a caller (guard recovers it).
const guardFrame = "github.com/idemreg/idemreg/storage/pebble.(*Store).guard"

// guard runs fn, a call into pebble that writes, and turns pebble's fatal
// error inside it into the failed store's answer. Pebble calls its
// Logger.Fatalf on the committing goroutine when the WAL write fails
// ("fatal commit error"); without guard that panic reached the gRPC
// recovery interceptor, every call answered INTERNAL, and health stayed
// SERVING (issue 28).
func (s *Store) guard(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			fp, ok := r.(fatalPanic)
			if !ok {
				panic(r)
			}
			err = fmt.Errorf("%w: pebble: %w", storage.ErrUnavailable, fmt.Errorf("%w: %w", storage.ErrFailed, fp.err))
		}
	}()
	return fn()
}

// commit commits b under guard, counts its bytes against the free space,
// and answers its failure.
func (s *Store) commit(b *pebble.Batch, o *pebble.WriteOptions) error {
	n := b.Len()
	err := s.guard(func() error { return b.Commit(o) })
	switch {
	case err == nil:
		s.disk.wrote(n)
		return nil
	case errors.Is(err, storage.ErrFailed):
		return err
	default:
		return unavailable("commit", err)
	}
}

// inGuard reports whether the calling goroutine runs inside guard.
func inGuard() bool {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	for {
		f, more := frames.Next()
		if f.Function == guardFrame {
			return true
		}
		if !more {
			return false
		}
	}
}

// exhausted classifies the errors of a short resource: a full file system
// (outside a commit, which pebble treats as fatal) and the process's open
// files. Nil for any other error.
func exhausted(what string, err error) error {
	switch {
	case errors.Is(err, syscall.ENOSPC):
		return &storage.ExhaustedError{Resource: storage.ResourceDisk, Detail: what + ": the file system is full", Err: err}
	case errors.Is(err, syscall.EMFILE), errors.Is(err, syscall.ENFILE):
		return &storage.ExhaustedError{Resource: storage.ResourceFileDescriptors, Detail: what + ": too many open files", Err: err}
	}
	return nil
}
