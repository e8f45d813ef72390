//go:build !linux

package tmpfs

import "errors"

var errNotLinux = errors.New("tmpfs mounts are Linux only")

func canMount() error { return errNotLinux }

func mount(string, int64, bool) error { return errNotLinux }

func unmount(string) error { return errNotLinux }
