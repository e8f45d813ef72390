package tmpfs

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func canMount() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("not root (uid %d)", os.Geteuid())
	}
	return nil
}

func mount(dir string, size int64, remount bool) error {
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if remount {
		flags |= unix.MS_REMOUNT
	}
	return unix.Mount("tmpfs", dir, "tmpfs", flags, fmt.Sprintf("size=%d,mode=0755", size))
}

func unmount(dir string) error {
	err := unix.Unmount(dir, 0)
	if errors.Is(err, unix.EBUSY) {
		// A process the test started may still hold a file: detach now,
		// the kernel frees it when the last holder goes.
		err = unix.Unmount(dir, unix.MNT_DETACH)
	}
	return err
}
