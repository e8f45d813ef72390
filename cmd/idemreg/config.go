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
	"time"

	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/postgres"
)

// config is everything serve, migrate and sweep read from flags and
// environment.
type config struct {
	Listen      string
	DatabaseURL string
	DataDir     string
	LogLevel    slog.Level
	LogFormat   string
	Limits      server.Limits
	// PolicyFile is the retention policy file (--config); empty means the
	// limits' defaults and bounds for every consumer.
	PolicyFile string
	// Surface is serve's transport security, identities, overload limits,
	// telemetry and extra listeners (surface.go).
	Surface surfaceConfig
	// SweepInterval is the time between serve's sweeps; zero turns them off.
	SweepInterval time.Duration
	// Sweep configures the sweeper of serve and of sweep.
	Sweep retention.Config
	// SQLBatchSize and SQLBatchWindow bound the coalescing of concurrent
	// Claims and Completes on the SQL store (postgres.WithBatching).
	SQLBatchSize   int
	SQLBatchWindow time.Duration
	SQLBatchSlots  int
	// PprofListen serves net/http/pprof there when set; on loopback only
	// unless PprofAllowRemote says otherwise.
	PprofListen      string
	PprofAllowRemote bool
	// ConsoleListen serves the operator console there when set; on
	// loopback only unless ConsoleAllowRemote says otherwise.
	ConsoleListen      string
	ConsoleAllowRemote bool
}

func defaultConfig() config {
	return config{
		Listen:    "127.0.0.1:7350",
		DataDir:   "./idemreg-data",
		LogLevel:  slog.LevelInfo,
		LogFormat: "json",
		Limits:    server.DefaultLimits(),
		Surface:   defaultSurface(),

		SQLBatchSize:   postgres.DefaultBatchSize,
		SQLBatchWindow: postgres.DefaultBatchWindow,
		SQLBatchSlots:  postgres.DefaultBatchInFlight,
		// serve sweeps by default: the embedded store has no other sweeper
		// (sweep cannot open it while serve holds it).
		SweepInterval: retention.DefaultInterval,
		Sweep: retention.Config{
			BatchSize:    retention.DefaultBatchSize,
			BatchTimeout: retention.DefaultBatchTimeout,
			Pause:        retention.DefaultPause,
		},
	}
}

const databaseURLUsage = "PostgreSQL or CockroachDB URL (postgres://...); empty uses the embedded store in --data-dir"

// bind registers the flags of cfg on fs.
func (c *config) bind(fs *flag.FlagSet, serve bool) {
	fs.StringVar(&c.DatabaseURL, "database-url", c.DatabaseURL, databaseURLUsage)
	if !serve {
		return
	}
	fs.StringVar(&c.Listen, "listen", c.Listen, "gRPC listen address")
	c.bindLocal(fs)
	fs.StringVar(&c.PolicyFile, "config", c.PolicyFile, "config file (YAML or JSON): retention policy (defaults and per-consumer lease and retention bounds, over the flags below), identities and rate limits; reloaded on SIGHUP")
	c.Surface.bind(fs)
	fs.DurationVar(&c.SweepInterval, "sweep-interval", c.SweepInterval, "time between sweeps of expired records; 0 turns the in-process sweeper off")
	fs.IntVar(&c.Sweep.BatchSize, "sweep-batch-size", c.Sweep.BatchSize, "most records one sweep batch deletes")
	fs.DurationVar(&c.Sweep.BatchTimeout, "sweep-batch-timeout", c.Sweep.BatchTimeout, "timeout of one sweep batch (the batch halves after one)")
	fs.IntVar(&c.SQLBatchSize, "sql-batch-size", c.SQLBatchSize, "SQL store: most concurrent Claims (or Completes) sent as one statement; 1 sends each alone")
	fs.DurationVar(&c.SQLBatchWindow, "sql-batch-window", c.SQLBatchWindow, "SQL store: longest a queued Claim or Complete waits for a statement slot before its batch is sent anyway")
	fs.IntVar(&c.SQLBatchSlots, "sql-batch-slots", c.SQLBatchSlots, "SQL store: statements of each kind (Claim, Complete) that run at once before calls queue into batches")
	fs.StringVar(&c.PprofListen, "pprof-listen", c.PprofListen, "serve net/http/pprof on this loopback address, without authentication (off when empty)")
	fs.BoolVar(&c.PprofAllowRemote, "pprof-allow-remote", c.PprofAllowRemote, "allow --pprof-listen on an address that is not loopback: anyone who reaches it can profile the process")
	fs.StringVar(&c.ConsoleListen, "console-listen", c.ConsoleListen, "serve the operator console (look up and invalidate records, as the signed-in identity) on http://ADDR, a loopback address (off when empty)")
	fs.BoolVar(&c.ConsoleAllowRemote, "console-allow-remote", c.ConsoleAllowRemote, "allow --console-listen on an address that is not loopback: the console speaks plaintext HTTP, so sign-in tokens and records cross the network unencrypted")
	l := &c.Limits
	fs.DurationVar(&l.DefaultLease, "default-lease", l.DefaultLease, "lease of a Claim or Extend that gives none")
	fs.DurationVar(&l.MinLease, "min-lease", l.MinLease, "smallest lease a request may ask for")
	fs.DurationVar(&l.MaxLease, "max-lease", l.MaxLease, "largest lease a request may ask for")
	fs.DurationVar(&l.DefaultMessageRetention, "default-message-retention", l.DefaultMessageRetention, "retention of a KIND_MESSAGE Claim that gives none")
	fs.DurationVar(&l.DefaultOperationRetention, "default-operation-retention", l.DefaultOperationRetention, "retention of a KIND_OPERATION Claim that gives none")
	fs.DurationVar(&l.MinRetention, "min-retention", l.MinRetention, "smallest retention a request may ask for")
	fs.DurationVar(&l.MaxRetention, "max-retention", l.MaxRetention, "largest retention a request may ask for")
	fs.DurationVar(&l.MaxLeaseTotal, "max-lease-total", l.MaxLeaseTotal, "longest one attempt may hold a key, its Claim's lease and every Extend together (at least --max-lease; 0: no bound)")
	fs.IntVar(&l.MaxResultBytes, "max-result-bytes", l.MaxResultBytes, "largest encoded result Complete accepts")
}

// bindLocal registers the flags of the embedded store and the logs.
func (c *config) bindLocal(fs *flag.FlagSet) {
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "directory of the embedded store, used when --database-url is empty")
	fs.TextVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: json or text")
}

// bindSweep registers the flags of the sweep command on fs.
func (c *config) bindSweep(fs *flag.FlagSet) {
	fs.StringVar(&c.DatabaseURL, "database-url", c.DatabaseURL, databaseURLUsage)
	c.bindLocal(fs)
	fs.IntVar(&c.Sweep.BatchSize, "batch-size", c.Sweep.BatchSize, "most records one batch deletes")
	fs.DurationVar(&c.Sweep.BatchTimeout, "batch-timeout", c.Sweep.BatchTimeout, "timeout of one batch; after a timeout the batch size halves")
	fs.DurationVar(&c.Sweep.Pause, "pause", c.Sweep.Pause, "mean pause between batches, jittered by ±50%, to leave the store to live traffic")
	fs.DurationVar(&c.Sweep.MaxDuration, "max-duration", c.Sweep.MaxDuration, "stop starting batches after this long (exit status 3 if expired records may be left); 0 means no limit")
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
			errs = append(errs, fmt.Errorf("--database-url must be a postgres:// URL, got %q", postgres.Redact(c.DatabaseURL)))
		}
	}
	if c.PprofListen != "" && !isLoopback(c.PprofListen) && !c.PprofAllowRemote {
		// Profiles, goroutine stacks and the heap show internals to
		// anyone who reaches the listener, which has no authentication.
		errs = append(errs, fmt.Errorf("--pprof-listen %s is not a loopback address: pprof has no authentication; bind it to loopback or pass --pprof-allow-remote explicitly", c.PprofListen))
	}
	if c.ConsoleListen != "" && !isLoopback(c.ConsoleListen) && !c.ConsoleAllowRemote {
		// The console has no TLS of its own: a token typed into it, and
		// every record it shows, would cross the network in the clear.
		errs = append(errs, fmt.Errorf("--console-listen %s is not a loopback address: the console serves plaintext HTTP; bind it to loopback (reach it through a tunnel or a TLS proxy) or pass --console-allow-remote explicitly", c.ConsoleListen))
	}
	if c.LogFormat != "json" && c.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("--log-format must be json or text, got %q", c.LogFormat))
	}
	if err := c.Limits.Validate(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, c.Surface.validate(c.Listen)...)
	if c.SweepInterval < 0 {
		errs = append(errs, fmt.Errorf("--sweep-interval must not be negative (0 turns sweeping off), got %v", c.SweepInterval))
	}
	switch {
	case c.Sweep.BatchSize < 1:
		errs = append(errs, fmt.Errorf("the sweep batch size must be positive, got %d", c.Sweep.BatchSize))
	case c.Sweep.BatchTimeout <= 0:
		errs = append(errs, fmt.Errorf("the sweep batch timeout must be positive, got %v", c.Sweep.BatchTimeout))
	case c.Sweep.Pause < 0:
		errs = append(errs, fmt.Errorf("the pause between sweep batches must not be negative, got %v", c.Sweep.Pause))
	}
	if err := c.sweeper(nil).Validate(); err != nil {
		errs = append(errs, fmt.Errorf("sweep: %w", err))
	}
	return errors.Join(errs...)
}

// sweeper returns the sweeper's configuration: a zero pause on the command
// line means none, where retention.Config takes zero for its default.
func (c *config) sweeper(logger *slog.Logger) retention.Config {
	rc := c.Sweep
	if rc.Pause == 0 {
		rc.Pause = -1
	}
	rc.Interval = c.SweepInterval
	rc.Logger = logger
	return rc
}

func (c *config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.LogLevel}
	if c.LogFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}
