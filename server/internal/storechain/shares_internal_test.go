package storechain

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestIdentitySharesRace races takes and gives of two identities: no
// identity ever holds more than its share, and every slot is given back.
func TestIdentitySharesRace(t *testing.T) {
	s := &identityShares{share: 3}
	var held [2]atomic.Int64
	var most [2]atomic.Int64
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			i := g % 2
			name := []string{"a", "b"}[i]
			for range 500 {
				if !s.take(name) {
					continue
				}
				n := held[i].Add(1)
				for {
					m := most[i].Load()
					if n <= m || most[i].CompareAndSwap(m, n) {
						break
					}
				}
				held[i].Add(-1)
				s.give(name)
			}
		})
	}
	wg.Wait()
	for i, name := range []string{"a", "b"} {
		require.LessOrEqual(t, most[i].Load(), int64(3), name)
		for range 3 {
			require.True(t, s.take(name), "every slot of %s was given back", name)
		}
		require.False(t, s.take(name))
	}
}
