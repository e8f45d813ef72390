package pebble

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

// metaRestoreFloor holds the restore floor: the greatest token that may
// have been issued before the directory was restored from a backup, on the
// timeline the backup came from or on the one it replaced. The store's
// clock never reads below the floor's next microsecond (Store.clock), so
// every token it issues after a restore is above it, however the wall
// clock stands.
var metaRestoreFloor = []byte{prefixMeta, 'r', 'e', 's', 't', 'o', 'r', 'e', '-', 'f', 'l', 'o', 'o', 'r'}

// ErrNotEmpty is returned by Restore when the data directory holds files
// and RestoreOptions.Force is not set.
var ErrNotEmpty = errors.New("pebble: the data directory is not empty")

// ErrBackupMismatch is returned by Restore when the restored files do not
// hold what the backup's manifest says they hold.
var ErrBackupMismatch = errors.New("pebble: the backup does not hold what its manifest says")

// loadRestoreFloor reads metaRestoreFloor into s.clockFloor.
func (s *Store) loadRestoreFloor() error {
	v, closer, err := s.db.Get(metaRestoreFloor)
	switch {
	case errors.Is(err, pebble.ErrNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("pebble: read restore floor: %w", err)
	}
	defer func() { _ = closer.Close() }()
	if len(v) != 8 {
		return fmt.Errorf("pebble: malformed restore floor %x", v)
	}
	s.clockFloor = time.UnixMicro(int64(binary.BigEndian.Uint64(v)) + 1).UTC()
	return nil
}

// RestoreOptions are the options of Restore.
type RestoreOptions struct {
	// Force replaces a data directory that holds files. Without it Restore
	// refuses one with ErrNotEmpty.
	Force bool
	// Now is the clock the restore floor takes the time from (time.Now
	// when nil).
	Now    func() time.Time
	Logger *slog.Logger
}

// RestoreResult says what Restore did.
type RestoreResult struct {
	// Records is the number of records restored.
	Records int64
	// TokenFloor is the restore floor: every token issued from now on is
	// greater.
	TokenFloor int64
	// Replaced is set when a data directory with files was replaced;
	// ReplacedHighWater is then the greatest token found in it (0 when it
	// could not be read: ReplacedErr says why).
	Replaced          bool
	ReplacedHighWater int64
	ReplacedErr       error
}

// Restore installs the backup whose files were copied, verified against m,
// into from as the data directory dataDir. from must be a directory beside
// dataDir (on its file system), which Restore renames; it is left alone
// when Restore fails.
//
// It refuses while a process holds dataDir's lock (ErrLocked), and a
// dataDir with files unless opts.Force. It opens the copy to check that it
// holds m.Records records and no token above m.TokenHighWater
// (ErrBackupMismatch), and persists in it the restore floor: the greatest
// of m.TokenHighWater, the greatest token in the directory it replaces (the
// timeline the backup lost, when dataDir is where the store served), and
// the clock's microseconds now, which stand above the tokens of any
// timeline unless a clock stood ahead of this one. Then it syncs the copy
// and renames it into place, so that dataDir is either what it was or the
// whole restored store.
func Restore(from, dataDir string, m storage.BackupManifest, opts RestoreOptions) (RestoreResult, error) {
	var res RestoreResult
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	empty, existed, err := dirEmpty(dataDir)
	if err != nil {
		return res, err
	}
	if !empty && !opts.Force {
		return res, fmt.Errorf("%w: %s (restore with --force to replace it)", ErrNotEmpty, dataDir)
	}
	if !existed {
		if err := os.Mkdir(dataDir, 0o750); err != nil {
			return res, fmt.Errorf("pebble: create %s: %w", dataDir, err)
		}
	}
	lock, err := lockDir(dataDir)
	if err != nil {
		if !existed {
			_ = os.RemoveAll(dataDir)
		}
		return res, err
	}
	installed := false
	defer func() {
		_ = lock.Close()
		if !existed && !installed {
			_ = os.RemoveAll(dataDir) // made here, and only the lock file in it
		}
	}()
	// Read again under the lock: a serve may have written it meanwhile.
	if empty, _, err = dirEmptyBut(dataDir, lockFileName); err != nil {
		return res, err
	}
	if !empty {
		if !opts.Force {
			return res, fmt.Errorf("%w: %s (restore with --force to replace it)", ErrNotEmpty, dataDir)
		}
		res.Replaced = true
		st, err := scanStore(dataDir)
		if err != nil {
			res.ReplacedErr = err
			opts.Logger.Warn("the data directory restore replaces could not be read: the restore floor relies on the clock for its tokens", "dir", dataDir, "err", err)
		} else {
			res.ReplacedHighWater = st.highWater
		}
	}

	st, err := scanStore(from)
	if err != nil {
		return res, fmt.Errorf("%w: %w", ErrBackupMismatch, err)
	}
	if st.records != m.Records || st.highWater > m.TokenHighWater {
		return res, fmt.Errorf("%w: %d records and tokens up to %d, the manifest says %d and %d",
			ErrBackupMismatch, st.records, st.highWater, m.Records, m.TokenHighWater)
	}
	res.Records = st.records
	res.TokenFloor = max(m.TokenHighWater, res.ReplacedHighWater, opts.Now().UnixMicro())
	if err := sealRestore(from, res.TokenFloor, opts.Logger); err != nil {
		return res, err
	}
	if err := syncTree(from); err != nil {
		return res, err
	}

	// dataDir holds the lock file only, or what Force replaces: move it
	// aside, move the copy in, and remove it. A crash between the renames
	// leaves no dataDir and the complete copy under from.
	aside := dataDir + ".replaced-" + filepath.Base(from)
	if err := os.Rename(dataDir, aside); err != nil {
		return res, fmt.Errorf("pebble: move %s aside: %w", dataDir, err)
	}
	if err := os.Rename(from, dataDir); err != nil {
		_ = os.Rename(aside, dataDir)
		return res, fmt.Errorf("pebble: move the restored store into %s: %w", dataDir, err)
	}
	installed = true
	if err := syncDir(filepath.Dir(dataDir)); err != nil {
		return res, err
	}
	if err := os.RemoveAll(aside); err != nil {
		opts.Logger.Warn("the replaced data directory could not be removed", "dir", aside, "err", err)
	}
	return res, nil
}

// sealRestore opens the restored store in dir as serve would (which checks
// its layout) and persists the restore floor in it, synced.
func sealRestore(dir string, floor int64, logger *slog.Logger) error {
	s, err := Open(dir, WithLogger(logger), WithDiskReserve(-1))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBackupMismatch, err)
	}
	if prev := s.clockFloor; !prev.IsZero() {
		floor = max(floor, prev.UnixMicro()-1)
	}
	err = s.set(metaRestoreFloor, binary.BigEndian.AppendUint64(nil, uint64(floor)), "write restore floor")
	if cerr := s.Close(); err == nil {
		err = cerr
	}
	return err
}

func dirEmpty(dir string) (empty, existed bool, err error) { return dirEmptyBut(dir, "") }

// dirEmptyBut reports whether dir holds nothing but a file named but, and
// whether it exists (a missing dir is empty).
func dirEmptyBut(dir, but string) (empty, existed bool, err error) {
	f, err := os.Open(dir)
	if errors.Is(err, os.ErrNotExist) {
		return true, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("pebble: %w", err)
	}
	defer func() { _ = f.Close() }()
	for {
		names, err := f.Readdirnames(16)
		for _, n := range names {
			if n != but {
				return false, true, nil
			}
		}
		if errors.Is(err, io.EOF) {
			return true, true, nil
		}
		if err != nil {
			return false, true, fmt.Errorf("pebble: read %s: %w", dir, err)
		}
	}
}

// syncTree fsyncs every file in dir, and dir.
func syncTree(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("pebble: %w", err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			return fmt.Errorf("pebble: %w", err)
		}
		err = f.Sync()
		_ = f.Close()
		if err != nil {
			return fmt.Errorf("pebble: sync %s: %w", e.Name(), err)
		}
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("pebble: %w", err)
	}
	defer func() { _ = f.Close() }()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pebble: sync %s: %w", dir, err)
	}
	return nil
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
