//go:build !unix

package registrytest

import (
	"errors"
	"io/fs"
	"os"
	"time"
)

// staleLock is how old a lock file may be before lockFile takes it over:
// longer than a build of the registry, on a machine without flock whose
// lock a killed process could leave behind.
const staleLock = 15 * time.Minute

// lockFile creates path exclusively, waiting while another process holds
// it, and removes it to unlock.
func lockFile(path string) (unlock func() error, err error) {
	for {
		f, err := os.OpenFile(path+".excl", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
		if err == nil {
			_ = f.Close()
			return func() error { return os.Remove(path + ".excl") }, nil
		}
		if !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		if fi, err := os.Stat(path + ".excl"); err == nil && time.Since(fi.ModTime()) > staleLock {
			_ = os.Remove(path + ".excl")
			continue
		}
		time.Sleep(200 * time.Millisecond)
	}
}
