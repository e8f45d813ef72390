package configfile

import (
	"context"
	"log/slog"
	"os"
	"time"
)

// Watch reloads the file of s when its content changes on disk, looked at
// every poll (0: never), and on every signal from hup (the caller
// subscribes it to SIGHUP), until ctx ends, logging each reload to
// logger. A pod cannot always be signalled (a distroless image has no
// kill), and a ConfigMap's update reaches its files by a symlink swap,
// which the poll sees as TLS files are seen (server/tlsfiles.go). A change
// is taken once the file has read the same for two polls' time, so that a
// file being written in place is not taken half-written; SIGHUP, which the
// operator sends once the file is written, takes it at once. Each reload
// is one read and one parse of the file, whose policy and access parts
// replace those in force together, or not at all.
func (s *Source) Watch(ctx context.Context, poll time.Duration, hup <-chan os.Signal, logger *slog.Logger) {
	var tick <-chan time.Time // nil: never
	if poll > 0 && s.path != "" {
		t := time.NewTicker(poll)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			if s.path == "" {
				logger.Warn("SIGHUP ignored: no config file (--config) to reload")
				continue
			}
			c, err := s.Reload()
			s.logReload(c, "SIGHUP", err, logger)
		case <-tick:
			// Two poll intervals of the same bytes: a file written in
			// place is not taken half-written, even by a writer that
			// pauses longer than one poll (ReloadIfChanged).
			c, changed, err := s.ReloadIfChanged(time.Now(), 2*poll)
			if changed {
				s.logReload(c, "file changed", err, logger)
			}
		}
	}
}

// logReload says what a reload did, and which file's version is in force:
// a file that is invalid in any part is logged with the reason, and the
// whole config in force stays.
func (s *Source) logReload(c *Config, trigger string, err error, logger *slog.Logger) {
	if err != nil {
		logger.Error("config reload rejected; the policy and access in force stay", "path", s.path, "trigger", trigger,
			"version", s.Current().Version, "error", err)
		return
	}
	logger.Info("config reloaded", "path", s.path, "trigger", trigger, "version", c.Version,
		"consumer_policies", c.Policy.Len(), "identities", c.Access.Identities())
}
