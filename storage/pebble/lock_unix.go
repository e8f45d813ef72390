//go:build unix

package pebble

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// lockFileName is the file whose flock marks a data directory as in use.
const lockFileName = "idemreg.lock"

// lockDir takes an exclusive flock on the directory's lock file. Pebble's own
// LOCK is an fcntl lock, which never conflicts within one process (pebble
// guards that with a table keyed by the path as spelled); a flock belongs to
// the open file, so a second Open in the same process conflicts as surely as
// one in another process, however the path is spelled. The kernel drops the
// lock when the process dies, so a crash leaves nothing to clean up.
func lockDir(dir string) (io.Closer, error) {
	path := filepath.Join(dir, lockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("pebble: open lock file: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is in use, probably by another idemreg process", ErrLocked, dir)
		}
		return nil, fmt.Errorf("pebble: lock %s: %w", path, err)
	}
	return f, nil
}
