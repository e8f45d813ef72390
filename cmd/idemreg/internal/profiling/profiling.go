// Package profiling serves net/http/pprof for serve's --pprof-listen. It
// is off by default and has no authentication: profiles show internals,
// so serve keeps it on loopback unless --pprof-allow-remote.
// /debug/pprof/cmdline shows the command line with every secret redacted:
// pprof's own handler prints os.Args, --database-url's password included.
package profiling

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"strings"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/storage/postgres"
)

// Serve serves net/http/pprof on addr until the returned function is
// called; /debug/pprof/cmdline shows args redacted. An empty addr serves
// nothing.
func Serve(addr string, args []string, bounds httpserve.Bounds, logger *slog.Logger) (stop func(), err error) {
	if addr == "" {
		return func() {}, nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", redactedCmdline(args))
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	stop, bound, err := httpserve.Serve("pprof", addr, mux, bounds, logger)
	if err != nil {
		return nil, err
	}
	logger.Info("pprof serving", "listen", bound.String())
	return stop, nil
}

// redactedCmdline answers as pprof.Cmdline does (the arguments separated
// by NUL bytes), with every argument redacted: the database URL, whichever
// form it takes, and anything else that carries a URL password or a
// password= parameter.
func redactedCmdline(args []string) http.HandlerFunc {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = postgres.Redact(a)
	}
	body := strings.Join(out, "\x00")
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, body)
	}
}
