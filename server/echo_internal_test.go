package server

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestTruncate(t *testing.T) {
	cases := []struct {
		name, in, want string
		n              int
	}{
		{"short", "billing", "billing", 8},
		{"exact", "billing", "billing", 7},
		{"cut", "billing.worker", "billing…(+7 bytes)", 7},
		{"inside a rune", "ab€cd", "ab…(+5 bytes)", 3}, // € is 3 bytes: not split
		{"invalid UTF-8 moves the cut at most 3 bytes", "a\x80\x80\x80\x80\x80", "a\x80…(+4 bytes)", 5},
		{"empty", "", "", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, truncate(tc.in, tc.n))
		})
	}
}

// FuzzTruncate: the result is a prefix of the input of at most n bytes
// plus the marker, stays valid UTF-8 when the input was, and the marker
// counts exactly the bytes cut.
func FuzzTruncate(f *testing.F) {
	f.Add("billing.payment-worker", 7)
	f.Add("ab€cd", 3)
	f.Add(strings.Repeat("é", 200), MaxEchoedFieldBytes)
	f.Fuzz(func(t *testing.T, s string, n int) {
		if n < 0 || n > 1<<16 {
			return
		}
		got := truncate(s, n)
		if len(s) <= n {
			require.Equal(t, s, got)
			return
		}
		prefix, marker, ok := strings.Cut(got, "…(+")
		require.True(t, ok, "marked: %q", got)
		require.True(t, strings.HasPrefix(s, prefix))
		require.LessOrEqual(t, len(prefix), n)
		require.GreaterOrEqual(t, len(prefix), n-(utf8.UTFMax-1))
		require.Equal(t, strconv.Itoa(len(s)-len(prefix))+" bytes)", marker)
		if utf8.ValidString(s) {
			require.True(t, utf8.ValidString(got))
		}
	})
}
