package reason

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bounds on what a request can make the server write. A request field
// reaches a log line or a status before validation has bounded it (the
// access log, authentication, authorization and rate limits all run before
// the handler validates), so a caller who sends a consumer of 1 MB must not
// get a log line or a status of 1 MB, and one who sends invalid UTF-8 must
// not get it back raw: every request field that is logged or echoed goes
// through Echo, and every status message and BadRequest description
// through Bounded (Status, and the server's violations). The bounds are documented in
// docs/operations.md ("Log and error bounds").
const (
	// MaxEchoedFieldBytes is the most bytes of one request field that a
	// log line, a status message or an ErrorInfo metadata value quotes; a
	// longer field is cut and marked with how much was left out. It is
	// MaxKeyBytes, so that a valid consumer or key is never cut.
	MaxEchoedFieldBytes = 256
	// MaxStatusMessageBytes bounds the message of every status the
	// middleware and the service build, whatever it quotes.
	MaxStatusMessageBytes = 1024
)

// Echo returns a request field as a log line, a status message or an
// ErrorInfo metadata value may quote it.
func Echo(s string) string { return Bounded(s, MaxEchoedFieldBytes) }

// Bounded returns s as text the server may send and log: printable UTF-8
// of at most n bytes, plus a marker saying how many bytes of s were cut,
// "…(+N bytes)" (the marker is not counted in n). A byte of invalid UTF-8
// and a rune that is not printable (the check of every stored text field,
// unprintable) are written as Go escapes: \xff, \x00, \n, \u200b.
//
// Printable text is returned as it is (only cut), so a valid consumer or
// key reads the same in a status as in the request. Invalid UTF-8 must
// never get through: protobuf refuses it in the string fields of
// google.rpc.Status and its details, and a status that does not encode
// loses its details on a unary call and fails a whole batch answer. A
// control character would rewrite a log line. The result is printable, so
// bounded of it is itself (when short enough): a message built from echoed
// fields can be bounded again without escaping twice.
func Bounded(s string, n int) string {
	if len(s) <= n && Unprintable(s) < 0 {
		return s
	}
	var b strings.Builder
	b.Grow(min(len(s), n) + len("…(+1048576 bytes)"))
	var buf [utf8.UTFMax * 3]byte
	i := 0
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		piece := buf[:0]
		switch {
		case r == utf8.RuneError && size == 1:
			const hex = "0123456789abcdef"
			piece = append(piece, '\\', 'x', hex[s[i]>>4], hex[s[i]&0xF])
		case !unicode.IsPrint(r):
			q := strconv.AppendQuoteRuneToASCII(piece, r) // '\n', '\u200b'
			piece = q[1 : len(q)-1]
		default:
			piece = append(piece, s[i:i+size]...)
		}
		if b.Len()+len(piece) > n {
			break
		}
		b.Write(piece)
		i += size
	}
	if i < len(s) {
		b.WriteString("…(+" + strconv.Itoa(len(s)-i) + " bytes)")
	}
	return b.String()
}

// Unprintable returns the index of the first byte of s that is not
// printable text (invalid UTF-8, or a rune unicode.IsPrint refuses), or -1
// when there is none. It is the one text check: the validation of every
// stored text field (the server's validation) and what Echo and Bounded let through
// unescaped.
func Unprintable(s string) int {
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7F {
				return i
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 || !unicode.IsPrint(r) {
			return i
		}
		i += size
	}
	return -1
}
