package pebble

import (
	"testing"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// TestConformance runs the whole suite on both kinds of store, each case
// on a store of its own (opening one costs little).
func TestConformance(t *testing.T) {
	t.Run("Disk", func(t *testing.T) {
		storagetest.All(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, t.TempDir(), WithClock(c.Now))
		})
	})
	t.Run("InMemory", func(t *testing.T) {
		storagetest.All(t, func(t *testing.T, c *storagetest.Clock) storage.Store {
			return openT(t, "", WithInMemory(), WithClock(c.Now))
		}, storagetest.Except("Admin", "ListPagingUnderConcurrentWrites' writers, unsynced in memory, outrun its listing of 1000 pages; the Admin cases run on disk"))
	})
}
