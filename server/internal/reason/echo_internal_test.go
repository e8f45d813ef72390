package reason

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestBounded(t *testing.T) {
	cases := []struct {
		name, in, want string
		n              int
	}{
		{"short", "billing", "billing", 8},
		{"exact", "billing", "billing", 7},
		{"cut", "billing.worker", "billing…(+7 bytes)", 7},
		{"inside a rune", "ab€cd", "ab…(+5 bytes)", 3}, // € is 3 bytes: not split
		{"printable non-ASCII kept", "clé ✓", "clé ✓", 16},
		{"invalid UTF-8 escaped", "c\xff\xc3\x28", `c\xff\xc3(`, 16},
		{"control characters escaped", "a\x00b\nc\x1b[2J\x7f", `a\x00b\nc\x1b[2J\x7f`, 64},
		{"format and non-ASCII spaces escaped", "a\u200bb\u00a0", `a\u200bb\u00a0`, 64},
		{"an escape is not split", "a\x80\x80\x80\x80\x80", `a\x80…(+4 bytes)`, 7},
		{"the marker counts the input's bytes", "\xff\xff\xff", `\xff…(+2 bytes)`, 5},
		{"empty", "", "", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, Bounded(tc.in, tc.n))
		})
	}
}

// FuzzBounded: the result is printable UTF-8 (so every protobuf string
// field takes it and no log line is rewritten), at most n bytes plus the
// marker, bounded again to itself, and for printable input a prefix of it
// whose marker counts exactly the bytes cut.
func FuzzBounded(f *testing.F) {
	f.Add("billing.payment-worker", 7)
	f.Add("ab€cd", 3)
	f.Add(strings.Repeat("é", 200), MaxEchoedFieldBytes)
	f.Add("c\xff\x00\n\u200b", 4)
	f.Fuzz(func(t *testing.T, s string, n int) {
		if n < 0 || n > 1<<16 {
			return
		}
		got := Bounded(s, n)
		require.True(t, utf8.ValidString(got), "%q", got)
		require.Equal(t, -1, Unprintable(got), "%q", got)
		prefix, marker, cut := strings.Cut(got, "…(+")
		require.LessOrEqual(t, len(prefix), n)
		if Unprintable(s) >= 0 {
			return
		}
		if len(s) <= n {
			require.Equal(t, s, got)
			return
		}
		require.True(t, cut, "marked: %q", got)
		require.True(t, strings.HasPrefix(s, prefix))
		require.GreaterOrEqual(t, len(prefix), n-(utf8.UTFMax-1))
		require.Equal(t, strconv.Itoa(len(s)-len(prefix))+" bytes)", marker)
		require.Equal(t, got, Bounded(got, len(got)), "bounded again, unchanged")
	})
}
