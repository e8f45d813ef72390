package pebble

import (
	"testing"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func TestAdminConformance(t *testing.T) {
	storagetest.RunAdmin(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
		return openT(t, t.TempDir(), WithClock(c.Now))
	})
}
