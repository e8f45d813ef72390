package main

import (
	"log/slog"
	"os"
	"runtime/debug"
)

// defaultGCPercent is serve's GOGC when the environment sets none.
//
// The server's live heap is a few MiB while every call allocates (HTTP/2
// frames, contexts, log fields, rows), so at Go's default of 100 the
// collector runs many times a second: under 64 concurrent callers a
// quarter of the server's CPU went to it. At 400 the heap may grow to five
// times the live data before a collection, which cut the server's CPU per
// call by about a quarter for some 15 MiB more resident memory; measured in
// docs/benchmarks.md. GOGC and GOMEMLIMIT in the environment still win (set
// GOMEMLIMIT to bound the heap in a container).
const defaultGCPercent = 400

// tuneGC applies defaultGCPercent unless GOGC is set.
func tuneGC(logger *slog.Logger) {
	if _, ok := os.LookupEnv("GOGC"); ok {
		return
	}
	debug.SetGCPercent(defaultGCPercent)
	logger.Debug("garbage collector target set", "gogc", defaultGCPercent)
}
