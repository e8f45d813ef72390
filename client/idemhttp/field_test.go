package idemhttp

import (
	"bytes"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
)

// The draft's section 2.1: the field is an Item Structured Header whose
// value is a String (RFC 9651, sections 3.3.3 and 4.2).
func TestParseKey(t *testing.T) {
	tests := []struct {
		name    string
		lines   []string
		bare    bool
		want    string
		wantErr bool
	}{
		{name: "the draft's example", lines: []string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, want: "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{name: "surrounding spaces", lines: []string{`  "k1"  `}, want: "k1"},
		{name: "escaped quote and backslash", lines: []string{`"a\"b\\c"`}, want: `a"b\c`},
		{name: "inner spaces are part of the string", lines: []string{`"order 42"`}, want: "order 42"},
		{name: "parameters are ignored", lines: []string{`"k1";a=1;b;c="x";d=?0;e=:aGk=:;f=tok/en;g=-1.5;h=@1700000000;i=%"x"`}, want: "k1"},
		{name: "an empty string is a String", lines: []string{`""`}, want: ""},
		{name: "a token is not a String", lines: []string{`k1`}, wantErr: true},
		{name: "a token with WithBareTokens", lines: []string{`k1-abc:42`}, bare: true, want: "k1-abc:42"},
		{name: "an integer is not a String", lines: []string{`42`}, wantErr: true},
		{name: "an integer is not a token either", lines: []string{`42`}, bare: true, wantErr: true},
		{name: "a byte sequence is not a String", lines: []string{`:aGk=:`}, wantErr: true},
		{name: "an empty field", lines: []string{``}, wantErr: true},
		{name: "two field lines are a list", lines: []string{`"a"`, `"b"`}, wantErr: true},
		{name: "two field lines even when equal", lines: []string{`"a"`, `"a"`}, wantErr: true},
		{name: "a list in one line", lines: []string{`"a", "b"`}, wantErr: true},
		{name: "no closing quote", lines: []string{`"abc`}, wantErr: true},
		{name: "a backslash escapes only quote and backslash", lines: []string{`"a\nb"`}, wantErr: true},
		{name: "non-ASCII", lines: []string{"\"caf\u00e9\""}, wantErr: true},
		{name: "a control byte", lines: []string{"\"a\tb\""}, wantErr: true},
		{name: "trailing garbage", lines: []string{`"a" x`}, wantErr: true},
		{name: "an uppercase parameter name", lines: []string{`"a";A=1`}, wantErr: true},
		{name: "a parameter without a value after =", lines: []string{`"a";b=`}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseKey(tt.lines, tt.bare)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("parseKey(%q) = %q, want an error", tt.lines, got)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("parseKey(%q) = %q, %v; want %q", tt.lines, got, err, tt.want)
			}
		})
	}
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{`"a"`, `"a\"b";x=1`, `k`, `"a", "b"`, `"`, `"\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		key, err := parseKey([]string{s}, false)
		if err != nil {
			return
		}
		// A key it accepts is printable ASCII, and serializing it back as
		// an sf-string parses to the same key.
		for i := 0; i < len(key); i++ {
			if key[i] < 0x20 || key[i] > 0x7e {
				t.Fatalf("parseKey(%q) accepted a non-printable key %q", s, key)
			}
		}
		var b bytes.Buffer
		b.WriteByte('"')
		for i := 0; i < len(key); i++ {
			if key[i] == '"' || key[i] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(key[i])
		}
		b.WriteByte('"')
		again, err := parseKey([]string{b.String()}, false)
		if err != nil || again != key {
			t.Fatalf("round trip of %q: %q, %v", key, again, err)
		}
	})
}

func TestResponseEncoding(t *testing.T) {
	in := storedResponse{status: 201, header: http.Header{"Content-Type": {"application/json"}, "Link": {"<a>", "<b>"}}, body: []byte(`{"id":1}`), fingerprint: []byte{1, 2, 3}}
	out, err := decodeResponse(in.encode())
	if err != nil {
		t.Fatal(err)
	}
	if out.status != 201 || string(out.body) != `{"id":1}` || out.header.Get("Content-Type") != "application/json" ||
		len(out.header.Values("Link")) != 2 || out.header.Values("Link")[1] != "<b>" || !bytes.Equal(out.fingerprint, []byte{1, 2, 3}) {
		t.Fatalf("decoded %+v", out)
	}
	// A response recorded before the fingerprint was kept with it.
	in.fingerprint = nil
	if out, err := decodeResponse(in.encode()); err != nil || out.fingerprint != nil || out.status != 201 {
		t.Fatalf("decoded %+v, %v", out, err)
	}
	for _, bad := range [][]byte{nil, {0x08}, []byte("garbage"), {0x08, 0x05}} {
		if _, err := decodeResponse(bad); err == nil {
			t.Errorf("decodeResponse(%x) accepted", bad)
		}
	}
}

// RegistryKey joins scope and key so that no two pairs share a registry
// key, and every pair fits the registry's 256 bytes; DefaultFingerprint,
// which shares its hash, is unchanged by it (records stored before compare
// equal).
func TestRegistryKey(t *testing.T) {
	pairs := [][2]string{
		{"alice:x", "K"}, {"alice", "x:K"}, {"alice", ":x:K"}, {"", "alice:x:K"}, {"alice:x:K", ""},
		{"a", "b"}, {"ab", ""}, {"", "ab"}, {strings.Repeat("s", 4096), strings.Repeat("k", 256)},
	}
	seen := map[string][2]string{}
	for _, p := range pairs {
		k := RegistryKey(p[0], p[1])
		if len(k) != 64 {
			t.Fatalf("RegistryKey(%q, %q) is %d bytes", p[0], p[1], len(k))
		}
		if q, ok := seen[k]; ok {
			t.Fatalf("RegistryKey(%q, %q) = RegistryKey(%q, %q)", p[0], p[1], q[0], q[1])
		}
		seen[k] = p
	}

	r, err := http.NewRequest(http.MethodPost, "/charges?x=1", nil)
	if err != nil {
		t.Fatal(err)
	}
	// The SHA-256 of 4 "POST", 12 "/charges?x=1" and 2 "{}", each length
	// big-endian on 8 bytes, as the fingerprint has always been.
	const want = "a7d52f8a1328c91a97018adbf7acc9d27f1e55baa396eee2522dd23881cbb4f1"
	got := hex.EncodeToString(DefaultFingerprint(r, []byte("{}")))
	if got != want {
		t.Fatalf("DefaultFingerprint changed: %s, want %s", got, want)
	}
}
