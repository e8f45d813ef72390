package postgres

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestPrefixEnd(t *testing.T) {
	for _, tc := range []struct {
		name, prefix, end string
		ok                bool
	}{
		{name: "empty: every consumer", prefix: "", ok: false},
		{name: "ascii", prefix: "tenant.", end: "tenant/", ok: true},
		{name: "two-byte code point", prefix: "caf\u00e9", end: "caf\u00ea", ok: true},
		{name: "past the surrogates", prefix: "a\ud7ff", end: "a\ue000", ok: true},
		{name: "into a longer encoding", prefix: "a\u007f", end: "a\u0080", ok: true},
		{name: "trailing maximum code points are dropped", prefix: "z\U0010FFFF\U0010FFFF", end: "{", ok: true},
		{name: "only maximum code points: unbounded", prefix: "\U0010FFFF", ok: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			end, ok := prefixEnd(tc.prefix)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.end, end)
			if ok {
				require.True(t, utf8.ValidString(end))
				require.Less(t, tc.prefix, end)
			}
		})
	}
}

// FuzzPrefixEnd: in code point order (Go's string order on valid UTF-8),
// a string is in [prefix, end) exactly when it starts with prefix.
func FuzzPrefixEnd(f *testing.F) {
	f.Add("tenant.", "tenant.a")
	f.Add("a\u00ff", "a\u0100")
	f.Add("z\U0010FFFF", "z\U0010FFFFa")
	f.Add("", "x")
	f.Fuzz(func(t *testing.T, prefix, s string) {
		if !utf8.ValidString(prefix) || !utf8.ValidString(s) {
			t.Skip()
		}
		end, ok := prefixEnd(prefix)
		in := s >= prefix && (!ok || s < end)
		require.Equal(t, strings.HasPrefix(s, prefix), in, "prefix %q end %q (%v) s %q", prefix, end, ok, s)
	})
}
