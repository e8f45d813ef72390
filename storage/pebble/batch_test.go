package pebble

import (
	"testing"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestBatcherConformance(t *testing.T) {
	storagetest.RunBatcher(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, t.TempDir(), WithClock(c.Now))
	})
}

func TestMixedBatcherConformance(t *testing.T) {
	storagetest.RunMixedBatcher(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, t.TempDir(), WithClock(c.Now))
	})
}
