//go:build unix

package registrytest

import (
	"os"
	"syscall"
)

// lockFile takes an exclusive flock on path, waiting for it. The kernel
// drops it when the process dies, so a test binary killed mid-build
// leaves no stale lock.
func lockFile(path string) (unlock func() error, err error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return f.Close, nil // closing the file releases the lock
}
