package server

import (
	"strconv"
	"unicode/utf8"
)

// Bounds on what a request can make the server write. A request field
// reaches a log line or a status before validation has bounded it (the
// access log, authentication, authorization and rate limits all run before
// the handler validates), so a caller who sends a consumer of 1 MB must not
// get a log line or a status of 1 MB: every request field that is logged or
// echoed goes through echo, and every status message through newStatus.
// The bounds are documented in docs/operations.md ("Log and error bounds").
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

// echo returns a request field as a log line or a status may quote it.
func echo(s string) string { return truncate(s, MaxEchoedFieldBytes) }

// truncate cuts s to at most n bytes, at a rune boundary so that valid
// UTF-8 stays valid, and appends a marker saying how many bytes were cut:
// "…(+N bytes)". The marker is not counted in n.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	// Back up to the start of the rune the cut falls in; at most
	// UTFMax-1 bytes, so that invalid UTF-8 cannot move the cut far.
	for i := 0; i < utf8.UTFMax-1 && cut > 0 && !utf8.RuneStart(s[cut]); i++ {
		cut--
	}
	return s[:cut] + "…(+" + strconv.Itoa(len(s)-cut) + " bytes)"
}
