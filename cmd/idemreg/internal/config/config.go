// Package config is what serve, sweep and rotate-claim-key read from
// their flags and the environment: the Config the flags set (each flag
// declared once, in flags.go), its defaults, its Validate, which refuses
// what cannot work together and names the flags in its errors, and the
// store it names (store.go).
package config

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
	"unicode"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sharedport"
	"github.com/idemreg/idemreg/internal/telemetry"
	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/storage/postgres"
)

// Config is everything serve, sweep and rotate-claim-key read from flags
// and environment: each field means what the help of the flag that sets
// it says (ServeFlags). The libraries' settings are bound straight into
// their configs (Server, Sweep, HTTP), whose Validate holds their bounds;
// the rest is the binary's own: listeners, files, the store and the logs.
type Config struct {
	Listen, MetricsListen, HealthListen string
	DatabaseURL, DataDir                string
	DataDirReserve                      int64 // pebble.WithDiskReserve: 0 its default, negative none
	LogLevel                            slog.Level
	LogFormat                           string
	// PolicyFile is the config file (--config); empty means the limits'
	// defaults and bounds for every consumer, and no identities.
	PolicyFile                           string
	ConfigPoll                           time.Duration
	TLS                                  server.TLSFiles
	Plaintext, AllowUnauthenticated      bool
	SQLBatchSize, SQLBatchSlots          int // postgres.WithBatching's
	SQLBatchWindow                       time.Duration
	PprofListen, ConsoleListen           string
	PprofAllowRemote, ConsoleAllowRemote bool
	ConsoleProxy                         console.ProxyConfig
	DisableHTTPAPI                       bool
	HTTPAPICORSOrigins                   string
	MaxConnectingPerSource               int // sharedport.WithMaxSniffingPerSource
	HTTP                                 httpserve.Bounds
	DescriptorSet                        string

	// Server is the server's configuration but for what serve builds
	// itself (logger, access, TLS, telemetry).
	Server server.Config
	// Sweep configures the sweeper of serve and of sweep. Sweep.Interval
	// is serve's time between sweeps, zero turning them off.
	Sweep retention.Config
}

// Default holds the libraries' defaults, so that -h shows them and a
// zero from the command line can be told from no flag.
func Default() Config {
	return Config{
		Listen:    "127.0.0.1:7350",
		DataDir:   "./idemreg-data",
		LogLevel:  slog.LevelInfo,
		LogFormat: "json",
		// As often as the TLS files are looked at; a ConfigMap update
		// takes the kubelet's sync period (about a minute) to land anyway.
		ConfigPoll: 10 * time.Second,

		MaxConnectingPerSource: sharedport.DefaultMaxSniffingPerSource,

		HTTP:           httpserve.DefaultBounds(),
		SQLBatchSize:   postgres.DefaultBatchSize,
		SQLBatchWindow: postgres.DefaultBatchWindow,
		SQLBatchSlots:  postgres.DefaultBatchInFlight,
		Server: server.Config{
			Limits:            server.DefaultLimits(),
			RequestTimeout:    server.DefaultRequestTimeout,
			MaxRequestTimeout: server.DefaultMaxRequestTimeout,
			MaxInFlight:       server.DefaultMaxInFlight,
			MaxWaiters:        server.DefaultMaxWaiters,
			WaitRecheck:       server.DefaultWaitRecheck,
			Replica:           server.Replica{HeartbeatInterval: server.DefaultHeartbeat, MemberLiveFor: server.DefaultLiveFor},
			QuotaRefresh:      server.DefaultQuotaRefresh,
			// Shown by -h; MaxWaitersPerIdentity stays 0 (half of
			// --max-waiters, whatever it is), as MaxInFlightPerIdentity.
			MaxQuotaConsumersPerIdentity: server.DefaultMaxQuotaConsumersPerIdentity,
			ParkedCountInterval:          server.DefaultParkedCountInterval,
			StreamWorkers:                server.DefaultStreamWorkers,
			StaticWindow:                 server.DefaultStaticWindow,
			RefusalLogRate:               server.DefaultRefusalLogRate,
			RefusalRate:                  server.DefaultRefusalRate,
			RefusalDelay:                 server.DefaultRefusalDelay,
			Keepalive:                    server.DefaultKeepalive(),
			Bounds:                       server.DefaultBounds(),
			ShutdownTimeout:              10 * time.Second,
			Readiness: server.Readiness{
				Window:          server.DefaultReadinessWindow,
				MinCalls:        server.DefaultReadinessMinCalls,
				MaxFailureRatio: server.DefaultReadinessMaxFailureRatio,
			},
		},
		// serve sweeps by default: the embedded store has no other sweeper
		// (sweep cannot open it while serve holds it).
		Sweep: retention.Config{
			Interval:     retention.DefaultInterval,
			BatchSize:    retention.DefaultBatchSize,
			BatchTimeout: retention.DefaultBatchTimeout,
			Pause:        retention.DefaultPause,
		},
	}
}

// Validate reports settings that cannot work together: the binary's own,
// then each library's Validate, its errors naming the flags.
func (c *Config) Validate() error {
	var errs []error
	if c.Listen == "" {
		errs = append(errs, errors.New("--listen is required"))
	}
	if c.DatabaseURL == "" && c.DataDir == "" {
		errs = append(errs, errors.New("either --database-url or --data-dir is required"))
	}
	if c.DatabaseURL != "" {
		errs = append(errs, ValidDatabaseURL(c.DatabaseURL))
	}
	if _, err := sharedport.CORSOrigins(c.HTTPAPICORSOrigins); err != nil {
		errs = append(errs, err)
	}
	if c.LogFormat != "json" && c.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("--log-format must be json or text, got %q", c.LogFormat))
	}
	if c.PprofListen != "" && !access.Loopback(c.PprofListen) && !c.PprofAllowRemote {
		// Profiles, goroutine stacks and the heap show internals to
		// anyone who reaches the listener, which has no authentication.
		errs = append(errs, fmt.Errorf("--pprof-listen %s is not a loopback address: pprof has no authentication; bind it to loopback or pass --pprof-allow-remote explicitly", c.PprofListen))
	}
	if c.ConsoleListen != "" && !access.Loopback(c.ConsoleListen) && !c.ConsoleAllowRemote {
		// The console has no TLS of its own: a token typed into it, and
		// every record it shows, would cross the network in the clear.
		errs = append(errs, fmt.Errorf("--console-listen %s is not a loopback address: the console serves plaintext HTTP; bind it to loopback (reach it through a tunnel or a TLS proxy) or pass --console-allow-remote explicitly", c.ConsoleListen))
	}
	errs = append(errs, c.ConsoleProxy.Validate(c.ConsoleListen))
	t := c.TLS
	if (t.CertFile == "") != (t.KeyFile == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key go together"))
	}
	if t.ClientCAFile != "" && t.CertFile == "" {
		errs = append(errs, errors.New("--tls-client-ca needs --tls-cert and --tls-key"))
	}
	if c.Plaintext && t.CertFile != "" {
		errs = append(errs, errors.New("--plaintext contradicts --tls-cert"))
	}
	if t.CertFile == "" && !c.Plaintext && c.Listen != "" && !access.Loopback(c.Listen) {
		errs = append(errs, fmt.Errorf("--listen %s is not a loopback address: serve TLS (--tls-cert, --tls-key) or pass --plaintext explicitly", c.Listen))
	}
	if err := c.HTTP.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.MaxConnectingPerSource <= 0 {
		errs = append(errs, fmt.Errorf("--max-connecting-per-source must be positive, got %d", c.MaxConnectingPerSource))
	}
	errs = append(errs, c.commandLineBounds()...)
	if err := c.Server.Validate(); err != nil {
		errs = append(errs, named(err))
	}
	if c.ConfigPoll < 0 {
		errs = append(errs, fmt.Errorf("--config-poll must not be negative (0: reload on SIGHUP only), got %v", c.ConfigPoll))
	}
	sw := c.Sweep
	if sw.Interval < 0 {
		errs = append(errs, fmt.Errorf("--sweep-interval must not be negative (0 turns sweeping off), got %v", sw.Interval))
		sw.Interval = 0 // said once, in the flag's words
	}
	if err := sw.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("sweep: %w", err))
	}
	return errors.Join(errs...)
}

// commandLineBounds are the server's and the sweeper's settings the
// command line refuses although the library would take them: a flag shows
// its default, so a zero given is not "the default", and is more likely
// meant as "no bound", which there is not; and the costs of counting too
// often. What the libraries refuse themselves is left to their Validate.
func (c *Config) commandLineBounds() []error {
	var errs []error
	s := c.Server
	if s.RequestTimeout == 0 || s.MaxRequestTimeout == 0 {
		errs = append(errs, errors.New("--request-timeout and --max-request-timeout must be positive"))
	}
	if s.MaxInFlight < 1 {
		errs = append(errs, fmt.Errorf("--max-in-flight must be positive, got %d", s.MaxInFlight))
	}
	if s.MaxInFlightPerIdentity > s.MaxInFlight {
		errs = append(errs, fmt.Errorf("--max-in-flight-per-identity must be between 0 (half of --max-in-flight) and --max-in-flight (%d), got %d", s.MaxInFlight, s.MaxInFlightPerIdentity))
	}
	if s.MaxWaiters < 1 {
		errs = append(errs, fmt.Errorf("--max-waiters must be positive, got %d", s.MaxWaiters))
	}
	if s.MaxWaitersPerIdentity > s.MaxWaiters {
		errs = append(errs, fmt.Errorf("--max-waiters-per-identity must be between 0 (half of --max-waiters) and --max-waiters (%d), got %d", s.MaxWaiters, s.MaxWaitersPerIdentity))
	}
	if s.MaxQuotaConsumersPerIdentity < 1 {
		errs = append(errs, fmt.Errorf("--max-quota-consumers-per-identity must be positive, got %d", s.MaxQuotaConsumersPerIdentity))
	}
	if s.WaitRecheck == 0 {
		errs = append(errs, fmt.Errorf("--wait-recheck must be between 1ms and %v, got 0s", server.MaxWait))
	}
	if s.QuotaRefresh < time.Second {
		errs = append(errs, fmt.Errorf("--quota-refresh must be at least 1s (each refresh counts every record of the consumers with a quota), got %v", s.QuotaRefresh))
	}
	if s.ParkedCountInterval > 0 && s.ParkedCountInterval < time.Second {
		errs = append(errs, fmt.Errorf("--parked-count-interval must be at least 1s, or 0 to turn the parked records gauge off, got %v", s.ParkedCountInterval))
	}
	if k := s.Keepalive; k.MaxConnectionAge == 0 || k.MaxConnectionIdle == 0 {
		errs = append(errs, fmt.Errorf("--max-connection-age and --max-connection-idle must be positive, got %v and %v", k.MaxConnectionAge, k.MaxConnectionIdle))
	}
	if b := s.Bounds; b.MaxHeaderListSize == 0 || b.MaxConcurrentStreams == 0 || b.MaxConnections <= 0 || b.MaxPublicStreams <= 0 || b.MaxCallsPerIdentity <= 0 || b.MaxPendingCalls <= 0 || b.ConnectionTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--max-header-list-size (%d), --max-concurrent-streams (%d), --max-connections (%d), --max-public-streams (%d), --max-calls-per-identity (%d), --max-pending-calls (%d) and --connection-timeout (%v) must be positive",
			b.MaxHeaderListSize, b.MaxConcurrentStreams, b.MaxConnections, b.MaxPublicStreams, b.MaxCallsPerIdentity, b.MaxPendingCalls, b.ConnectionTimeout))
	}
	if r := s.Readiness; r.Window <= 0 || r.MinCalls <= 0 || r.MaxFailureRatio <= 0 {
		errs = append(errs, fmt.Errorf("--readiness-window (%d), --readiness-min-calls (%d) and --readiness-max-failure-ratio (%v) must be positive", r.Window, r.MinCalls, r.MaxFailureRatio))
	}
	if s.ShutdownTimeout == 0 {
		errs = append(errs, errors.New("--shutdown-timeout must be positive"))
	}
	if sw := c.Sweep; sw.BatchSize == 0 {
		errs = append(errs, errors.New("the sweep batch size must be positive, got 0"))
	} else if sw.BatchTimeout == 0 {
		errs = append(errs, errors.New("the sweep batch timeout must be positive, got 0s"))
	}
	return errs
}

// named gives the server's field errors the names of the flags that set
// the fields: each is the field's name in kebab case.
func named(err error) error {
	errs := []error{err}
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		errs = joined.Unwrap()
	}
	var out []error
	for _, e := range errs {
		if ce, ok := e.(*server.ConfigError); ok {
			field := ce.Field[strings.LastIndex(ce.Field, ".")+1:]
			var name strings.Builder
			for i, r := range field {
				if unicode.IsUpper(r) && i > 0 {
					name.WriteByte('-')
				}
				name.WriteRune(unicode.ToLower(r))
			}
			e = fmt.Errorf("--%s %s, got %v", name.String(), ce.Problem, ce.Value)
		}
		out = append(out, e)
	}
	return errors.Join(out...)
}

// Sweeper is the sweeper's configuration, logging to logger.
func (c *Config) Sweeper(logger *slog.Logger) retention.Config {
	rc := c.Sweep
	rc.Logger = logger
	return rc
}

// Logger is the command's logger, which every package it wires is given:
// durations as "1m0s", and the trace and span of a traced call's lines
// (telemetry.NewLogger).
func (c *Config) Logger(w io.Writer) *slog.Logger {
	return telemetry.NewLogger(w, c.LogFormat, c.LogLevel)
}
