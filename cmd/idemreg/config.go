package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strings"

	"github.com/idemreg/idemreg/server"
)

// config is everything serve and migrate read from flags and environment.
type config struct {
	Listen      string
	DatabaseURL string
	DataDir     string
	LogLevel    slog.Level
	LogFormat   string
	Limits      server.Limits
}

func defaultConfig() config {
	return config{
		Listen:    "127.0.0.1:7350",
		DataDir:   "./idemreg-data",
		LogLevel:  slog.LevelInfo,
		LogFormat: "json",
		Limits:    server.DefaultLimits(),
	}
}

// bind registers the flags of cfg on fs.
func (c *config) bind(fs *flag.FlagSet, serve bool) {
	fs.StringVar(&c.DatabaseURL, "database-url", c.DatabaseURL, "PostgreSQL or CockroachDB URL (postgres://...); empty uses the embedded store in --data-dir")
	if !serve {
		return
	}
	fs.StringVar(&c.Listen, "listen", c.Listen, "gRPC listen address")
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "directory of the embedded store, used when --database-url is empty")
	fs.TextVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: json or text")
	l := &c.Limits
	fs.DurationVar(&l.DefaultLease, "default-lease", l.DefaultLease, "lease of a Claim or Extend that gives none")
	fs.DurationVar(&l.MinLease, "min-lease", l.MinLease, "smallest lease a request may ask for")
	fs.DurationVar(&l.MaxLease, "max-lease", l.MaxLease, "largest lease a request may ask for")
	fs.DurationVar(&l.DefaultMessageRetention, "default-message-retention", l.DefaultMessageRetention, "retention of a KIND_MESSAGE Claim that gives none")
	fs.DurationVar(&l.DefaultOperationRetention, "default-operation-retention", l.DefaultOperationRetention, "retention of a KIND_OPERATION Claim that gives none")
	fs.DurationVar(&l.MinRetention, "min-retention", l.MinRetention, "smallest retention a request may ask for")
	fs.DurationVar(&l.MaxRetention, "max-retention", l.MaxRetention, "largest retention a request may ask for")
	fs.IntVar(&l.MaxResultBytes, "max-result-bytes", l.MaxResultBytes, "largest encoded result Complete accepts")
}

// parse reads environment variables first, then flags, so flags win.
func parse(fs *flag.FlagSet, args []string) error {
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		name := "IDEMREG_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(name); ok {
			if err := f.Value.Set(v); err != nil {
				envErr = errors.Join(envErr, fmt.Errorf("%s: %w", name, err))
			}
		}
	})
	if envErr != nil {
		return envErr
	}
	return fs.Parse(args)
}

// Validate reports settings that cannot work together.
func (c *config) Validate() error {
	var errs []error
	if c.Listen == "" {
		errs = append(errs, errors.New("--listen is required"))
	}
	if c.DatabaseURL == "" && c.DataDir == "" {
		errs = append(errs, errors.New("either --database-url or --data-dir is required"))
	}
	if c.DatabaseURL != "" {
		if u, err := url.Parse(c.DatabaseURL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
			errs = append(errs, fmt.Errorf("--database-url must be a postgres:// URL, got %q", redact(c.DatabaseURL)))
		}
	}
	if c.LogFormat != "json" && c.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("--log-format must be json or text, got %q", c.LogFormat))
	}
	if err := c.Limits.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (c *config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.LogLevel}
	if c.LogFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

// redact hides the password of a database URL for logs and errors.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}
