package pebble

import (
	"testing"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestUsageConformance(t *testing.T) {
	storagetest.RunUsage(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, t.TempDir(), WithClock(c.Now))
	})
}
