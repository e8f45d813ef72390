package command

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStatus: the outermost exit status wins (sweep wraps a store's
// failure to open, which carries its own, in its status 1), wrapping
// keeps it, and an error without one has none.
func TestStatus(t *testing.T) {
	inner := Exit(75, errors.New("disk full"))
	code, ok := Status(fmt.Errorf("opening: %w", inner))
	require.True(t, ok)
	require.Equal(t, 75, code)
	require.ErrorContains(t, inner, "disk full")

	code, ok = Status(Exit(1, fmt.Errorf("sweep: %w", inner)))
	require.True(t, ok)
	require.Equal(t, 1, code)

	_, ok = Status(errors.New("plain"))
	require.False(t, ok)
	_, ok = Status(nil)
	require.False(t, ok)
}
