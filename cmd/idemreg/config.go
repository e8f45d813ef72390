package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sharedport"
	"github.com/idemreg/idemreg/internal/telemetry"
	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage/postgres"
)

// config is everything serve, migrate and sweep read from flags and
// environment. The libraries' settings are bound straight into their
// configs (Server, Sweep), whose Validate holds their bounds; the rest is
// the binary's own: listeners, files, the store and the logs.
type config struct {
	Listen      string
	DatabaseURL string
	DataDir     string
	// DataDirReserve is the embedded store's reserve of free space
	// (pebble.WithDiskReserve): 0 its default, negative none.
	DataDirReserve int64
	LogLevel       slog.Level
	LogFormat      string
	// PolicyFile is the config file (--config); empty means the limits'
	// defaults and bounds for every consumer, and no identities.
	PolicyFile string
	// ConfigPoll is how often PolicyFile is looked at for a change on
	// disk; 0: only SIGHUP reloads it.
	ConfigPoll time.Duration
	// TLS are serve's certificate, key and client CAs; Plaintext allows
	// serving without TLS on an address that is not loopback, and
	// AllowUnauthenticated without identities.
	TLS                             server.TLSFiles
	Plaintext, AllowUnauthenticated bool
	MetricsListen, HealthListen     string
	// SQLBatchSize, SQLBatchWindow and SQLBatchSlots bound the coalescing
	// of concurrent Claims and Completes on the SQL store
	// (postgres.WithBatching).
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
	// ConsoleProxy signs operators in from a trusted proxy's header
	// (console.go); off unless its Header is set.
	ConsoleProxy consoleProxyFlags
	// DisableHTTPAPI keeps the gRPC port to gRPC: no Connect, gRPC-Web or
	// HTTP/JSON on it (sharedport.go).
	DisableHTTPAPI bool
	// HTTPAPICORSOrigins lists the browser origins (comma-separated, or
	// "*") whose pages may call the HTTP API from another origin; empty:
	// same-origin pages only.
	HTTPAPICORSOrigins string
	// MaxConnectingPerSource bounds the connections of one source address
	// on --listen still being told apart, gRPC from the HTTP API
	// (sharedport.Split).
	MaxConnectingPerSource int
	// HTTP bounds the metrics, console and pprof listeners, and the HTTP
	// API's side of the gRPC port.
	HTTP httpserve.Bounds
	// DescriptorSet is a binary FileDescriptorSet of the message types,
	// beside the linked ones, whose responses an operator's resolution is
	// checked against and may give as JSON; empty: the linked ones only.
	DescriptorSet string

	// Server is the server's configuration but for what serve builds
	// itself (logger, access, TLS, telemetry).
	Server server.Config
	// Sweep configures the sweeper of serve and of sweep. Sweep.Interval
	// is serve's time between sweeps, zero turning them off.
	Sweep retention.Config
}

// defaultConfig holds the libraries' defaults, so that -h shows them and a
// zero from the command line can be told from no flag.
func defaultConfig() config {
	return config{
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

// bindCommon registers the flags serve and sweep share: the store and the
// logs.
func (c *config) bindCommon(fs *flag.FlagSet) {
	fs.StringVar(&c.DatabaseURL, "database-url", c.DatabaseURL, "PostgreSQL or CockroachDB URL (postgres://...); empty uses the embedded store in --data-dir")
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "directory of the embedded store, used when --database-url is empty")
	fs.TextVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: json or text")
}

// bindServe registers the flags of serve.
func (c *config) bindServe(fs *flag.FlagSet) {
	c.bindCommon(fs)
	fs.StringVar(&c.Listen, "listen", c.Listen, "gRPC listen address")
	fs.Int64Var(&c.DataDirReserve, "data-dir-reserve", c.DataDirReserve, "free bytes the embedded store keeps on its file system: below it Claims that would start an attempt are refused (RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED), below half of it results over 64 KiB too; 0: 256 MiB or a quarter of the file system, whichever is less; negative: none")
	fs.StringVar(&c.PolicyFile, "config", c.PolicyFile, "config file (YAML or JSON): retention policy (defaults and per-consumer lease and retention bounds, over the flags below), identities and rate limits; reloaded, whole or not at all, when it changes on disk (checked every --config-poll) and on SIGHUP")
	durationVar(fs, &c.ConfigPoll, "config-poll", c.ConfigPoll, "how often --config is read for a change on disk (a ConfigMap update, an edit); 0: only SIGHUP reloads it")
	fs.StringVar(&c.TLS.CertFile, "tls-cert", c.TLS.CertFile, "PEM certificate chain of the server; with --tls-key, serve TLS (files are re-read when they change)")
	fs.StringVar(&c.TLS.KeyFile, "tls-key", c.TLS.KeyFile, "PEM private key of --tls-cert")
	fs.StringVar(&c.TLS.ClientCAFile, "tls-client-ca", c.TLS.ClientCAFile, "PEM CAs of client certificates: every client must present one they sign (mTLS); identities match its URI SAN, DNS SAN or subject")
	fs.BoolVar(&c.Plaintext, "plaintext", c.Plaintext, "serve without TLS on an address that is not loopback (behind a mesh that encrypts)")
	fs.BoolVar(&c.AllowUnauthenticated, "allow-unauthenticated", c.AllowUnauthenticated, "serve an address that is not loopback without identities in --config: every caller may use every consumer")
	fs.StringVar(&c.MetricsListen, "metrics-listen", c.MetricsListen, "serve Prometheus metrics on http://ADDR/metrics (off when empty)")
	fs.StringVar(&c.HealthListen, "health-listen", c.HealthListen, "serve grpc.health.v1 alone, in plaintext, on this address, for Kubernetes gRPC probes (off when empty)")
	fs.IntVar(&c.SQLBatchSize, "sql-batch-size", c.SQLBatchSize, "SQL store: most concurrent Claims (or Completes) sent as one statement; 1 sends each alone")
	durationVar(fs, &c.SQLBatchWindow, "sql-batch-window", c.SQLBatchWindow, "SQL store: longest a queued Claim or Complete waits for a statement slot before its batch is sent anyway")
	fs.IntVar(&c.SQLBatchSlots, "sql-batch-slots", c.SQLBatchSlots, "SQL store: statements of each kind (Claim, Complete) that run at once before calls queue into batches")
	fs.StringVar(&c.PprofListen, "pprof-listen", c.PprofListen, "serve net/http/pprof on this loopback address, without authentication (off when empty)")
	fs.BoolVar(&c.PprofAllowRemote, "pprof-allow-remote", c.PprofAllowRemote, "allow --pprof-listen on an address that is not loopback: anyone who reaches it can profile the process")
	fs.StringVar(&c.ConsoleListen, "console-listen", c.ConsoleListen, "serve the operator console (status, records to list, inspect, resolve and invalidate, one by one or many at once, as the signed-in operator) on this address; loopback only unless --console-allow-remote (off when empty)")
	c.ConsoleProxy.bind(fs)
	fs.BoolVar(&c.ConsoleAllowRemote, "console-allow-remote", c.ConsoleAllowRemote, "allow --console-listen on an address that is not loopback: the console speaks plaintext HTTP, so sign-in tokens and records cross the network unencrypted")
	fs.BoolVar(&c.DisableHTTPAPI, "disable-http-api", c.DisableHTTPAPI, "answer only gRPC on --listen: no Connect protocol, gRPC-Web or HTTP/JSON (HTTP/1.1) beside it")
	fs.StringVar(&c.HTTPAPICORSOrigins, "http-api-cors-origins", c.HTTPAPICORSOrigins, "browser origins (https://app.example.com, comma-separated, or *) whose pages may call the HTTP API on --listen; empty: none but the same origin")
	fs.IntVar(&c.MaxConnectingPerSource, "max-connecting-per-source", c.MaxConnectingPerSource, "most connections of one source IP on --listen whose first bytes (TLS ClientHello, HTTP/2 preface or HTTP/1.1 request) have not arrived yet, of the "+strconv.Itoa(sharedport.MaxSniffing)+" at once; beyond it its new ones are closed at once, so that a source that connects and sends nothing keeps no other waiting")
	h := &c.HTTP
	fs.IntVar(&h.MaxConnections, "http-max-connections", h.MaxConnections, "most connections each HTTP listener (metrics, console, pprof, the HTTP API) holds open; at it a new one takes the place of an idle one, or is closed at once if none is idle")
	fs.IntVar(&h.MaxConnectionsPerSource, "http-max-connections-per-source", h.MaxConnectionsPerSource, "most connections one source IP holds open on each HTTP listener; at it its new one takes the place of one of its idle ones, or is closed at once if none is idle")
	durationVar(fs, &h.MaxConnectionAge, "http-max-connection-age", h.MaxConnectionAge, "HTTP listeners: a kept-alive connection idle after this long is closed (each request renews --http-idle-timeout)")
	durationVar(fs, &h.ReadHeaderTimeout, "http-read-header-timeout", h.ReadHeaderTimeout, "HTTP listeners: longest a request's headers, or a new connection's first request, may take to arrive")
	durationVar(fs, &h.ReadTimeout, "http-read-timeout", h.ReadTimeout, "HTTP listeners: longest a whole request, body included, may take to arrive")
	durationVar(fs, &h.WriteTimeout, "http-write-timeout", h.WriteTimeout, "HTTP listeners: longest a response may take, from the end of the request's headers (a pprof profile or trace may ask for at most this long)")
	durationVar(fs, &h.IdleTimeout, "http-idle-timeout", h.IdleTimeout, "HTTP listeners: how long a kept-alive connection may wait for its next request")
	fs.IntVar(&h.MaxHeaderBytes, "http-max-header-bytes", h.MaxHeaderBytes, "HTTP listeners: largest request headers, in bytes")
	fs.StringVar(&c.DescriptorSet, "descriptor-set", c.DescriptorSet, "binary FileDescriptorSet (buf build -o FILE.binpb, protoc --include_imports --descriptor_set_out=FILE) of the services' response types: a resolution's response of one of them must decode as it, and may be given as JSON (the google.protobuf types are known without it); read at start")
	durationVar(fs, &c.Sweep.Interval, "sweep-interval", c.Sweep.Interval, "time between sweeps of expired records; 0 turns the in-process sweeper off")
	fs.IntVar(&c.Sweep.BatchSize, "sweep-batch-size", c.Sweep.BatchSize, "most records one sweep batch deletes")
	durationVar(fs, &c.Sweep.BatchTimeout, "sweep-batch-timeout", c.Sweep.BatchTimeout, "timeout of one sweep batch (the batch halves after one)")

	// The server's flags are named after the fields they set
	// (MaxInFlight is --max-in-flight), so its errors name them (named).
	s := &c.Server
	l := &s.Limits
	durationVar(fs, &l.DefaultLease, "default-lease", l.DefaultLease, "lease of a Claim or Extend that gives none")
	durationVar(fs, &l.MinLease, "min-lease", l.MinLease, "smallest lease a request may ask for")
	durationVar(fs, &l.MaxLease, "max-lease", l.MaxLease, "largest lease a request may ask for")
	durationVar(fs, &l.DefaultMessageRetention, "default-message-retention", l.DefaultMessageRetention, "retention of a KIND_MESSAGE Claim that gives none")
	durationVar(fs, &l.DefaultOperationRetention, "default-operation-retention", l.DefaultOperationRetention, "retention of a KIND_OPERATION Claim that gives none")
	durationVar(fs, &l.MinRetention, "min-retention", l.MinRetention, "smallest retention a request may ask for")
	durationVar(fs, &l.MaxRetention, "max-retention", l.MaxRetention, "largest retention a request may ask for")
	durationVar(fs, &l.MaxLeaseTotal, "max-lease-total", l.MaxLeaseTotal, "longest one attempt may hold a key, its Claim's lease and every Extend together (at least --max-lease; 0: no bound)")
	fs.IntVar(&l.MaxResultBytes, "max-result-bytes", l.MaxResultBytes, "largest encoded result Complete accepts")
	durationVar(fs, &s.RequestTimeout, "request-timeout", s.RequestTimeout, "budget of a request that carries no deadline")
	durationVar(fs, &s.MaxRequestTimeout, "max-request-timeout", s.MaxRequestTimeout, "longest deadline a request may carry; longer ones are cut to it")
	fs.IntVar(&s.MaxInFlight, "max-in-flight", s.MaxInFlight, "most store operations at once; beyond it calls fail at once with UNAVAILABLE (OVERLOADED)")
	fs.IntVar(&s.MaxInFlightPerIdentity, "max-in-flight-per-identity", s.MaxInFlightPerIdentity, "most store operations at once of one identity of --config, so one tenant cannot take every slot (0: half of --max-in-flight; --max-in-flight turns it off)")
	fs.IntVar(&s.MaxWaiters, "max-waiters", s.MaxWaiters, "most Claims waiting at once for a key in progress (ClaimRequest.wait); beyond it a Claim answers at once")
	fs.IntVar(&s.MaxWaitersPerIdentity, "max-waiters-per-identity", s.MaxWaitersPerIdentity, "most Claims of one identity of --config waiting at once, so one tenant cannot take every wait slot (0: half of --max-waiters; --max-waiters turns it off)")
	durationVar(fs, &s.WaitRecheck, "wait-recheck", s.WaitRecheck, "how often a waiting Claim looks for changes made through other replicas: how late it may wake for them")
	fs.StringVar(&s.Replica.AdvertiseAddress, "advertise-address", s.Replica.AdvertiseAddress, "host:port where the other replicas reach this one's --listen, written to the store's membership (empty: --listen, or the host name and its port when its host is 0.0.0.0 or [::]; in Kubernetes, the pod IP from the downward API)")
	durationVar(fs, &s.Replica.HeartbeatInterval, "heartbeat-interval", s.Replica.HeartbeatInterval, "how often this replica writes its heartbeat to the store's membership and reads the other replicas")
	durationVar(fs, &s.Replica.MemberLiveFor, "member-live-for", s.Replica.MemberLiveFor, "how old a replica's heartbeat may be, by the store's clock, for the others to count it as live (more than --heartbeat-interval)")
	durationVar(fs, &s.QuotaRefresh, "quota-refresh", s.QuotaRefresh, "how often the live records and bytes of the consumers with a quota (max_records, max_bytes in --config) are counted in the store: how late a replica learns of other replicas' new keys")
	fs.IntVar(&s.MaxQuotaConsumersPerIdentity, "max-quota-consumers-per-identity", s.MaxQuotaConsumersPerIdentity, "most consumers with a quota (max_records, max_bytes in --config) a replica follows for one identity; beyond it their new keys are refused (QUOTA_EXCEEDED) until one of its consumers is idle for "+strconv.Itoa(server.QuotaIdleRefreshes)+" quota refreshes")
	offAtZeroVar(fs, &s.ParkedCountInterval, policy.ParseDuration, "parked-count-interval", "how often the parked records of every consumer are counted in the store (from its index of parked records) for the idemreg_parked_records gauge; 0 turns the gauge off")
	offAtZeroVar(fs, &s.RefusalLogRate, strconv.Atoi, "refusal-log-rate", "access log lines written a second for each identity and refusal code (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT); the others are counted in idemreg_access_log_sampled_out_total (0: every line)")
	fs.Float64Var(&s.RefusalRate, "refusal-rate", s.RefusalRate, "refusals (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT) a second each caller may draw, an identity or, without one, a source IP, before each further one is answered only after --refusal-delay (burst: twice it; 0: never held); idemreg_refusals_slowed_total counts them")
	durationVar(fs, &s.RefusalDelay, "refusal-delay", s.RefusalDelay, "how long a refusal beyond --refusal-rate is held before it is answered (at most half of what is left of the call's deadline)")
	offAtZeroVar(fs, &s.StreamWorkers, strconv.Atoi, "stream-workers", "goroutines kept to run calls, reusing their stacks (0: a new goroutine per call)")
	offAtZeroVar(fs, &s.StaticWindow, strconv.Atoi, "static-window", "the HTTP/2 flow-control window of every stream and connection of --listen, fixed, in bytes (at least 65536), so that grpc-go sends no bandwidth-estimating PING with each small message it receives; clients should dial with the same (grpc.WithStaticStreamWindowSize, WithStaticConnWindowSize) (0: grpc-go's dynamic windows)")
	durationVar(fs, &s.Keepalive.MaxConnectionAge, "max-connection-age", s.Keepalive.MaxConnectionAge, "close client connections after about this long (clients reconnect, so load spreads over new replicas)")
	durationVar(fs, &s.Keepalive.MaxConnectionIdle, "max-connection-idle", s.Keepalive.MaxConnectionIdle, "close client connections that have had no call for this long")
	b := &s.Bounds
	fs.Var(uint32Value{&b.MaxHeaderListSize}, "max-header-list-size", "largest header list of one call, in bytes (names, values and 32 bytes per field); a call over it is refused before any handler")
	fs.Var(uint32Value{&b.MaxConcurrentStreams}, "max-concurrent-streams", "most calls open at once on one connection; clients queue beyond it")
	fs.IntVar(&b.MaxConnections, "max-connections", b.MaxConnections, "most connections each listener (gRPC, health) holds open; beyond it new ones wait to be accepted")
	fs.IntVar(&b.MaxHealthConnectionsPerSource, "max-health-connections-per-source", b.MaxHealthConnectionsPerSource, "most connections one source IP holds open on --health-listen, of its --max-connections; beyond it its new ones are closed at once, so that a flood from one source leaves the kubelet's probes a slot")
	fs.IntVar(&b.MaxPublicStreams, "max-public-streams", b.MaxPublicStreams, "most health Watch and reflection streams (which need no credentials) open at once; beyond it they fail with RESOURCE_EXHAUSTED")
	fs.IntVar(&b.MaxCallsPerIdentity, "max-calls-per-identity", b.MaxCallsPerIdentity, "most calls one identity of --config has in progress at once; beyond it they fail with RESOURCE_EXHAUSTED (TOO_MANY_CALLS)")
	fs.IntVar(&b.MaxPendingCalls, "max-pending-calls", b.MaxPendingCalls, "most calls whose request message has not arrived yet, both listeners (gRPC, health) together, half on each; beyond it they fail at once with RESOURCE_EXHAUSTED (TOO_MANY_STREAMS), before credentials are checked")
	durationVar(fs, &b.ConnectionTimeout, "connection-timeout", b.ConnectionTimeout, "longest a new connection may take over its TLS and HTTP/2 handshakes")
	r := &s.Readiness
	fs.IntVar(&r.Window, "readiness-window", r.Window, "health intervals (2 s each) over which the store calls' failure rate decides readiness")
	fs.IntVar(&r.MinCalls, "readiness-min-calls", r.MinCalls, "fewest store calls in the readiness window for their failure rate to count")
	fs.Float64Var(&r.MaxFailureRatio, "readiness-max-failure-ratio", r.MaxFailureRatio, "share of failed store calls in the readiness window, in (0, 1], at which serve reports NOT_SERVING")
	durationVar(fs, &s.DrainDelay, "drain-delay", s.DrainDelay, "on SIGTERM, keep serving this long after health turns NOT_SERVING, for load balancers to notice")
	durationVar(fs, &s.ShutdownTimeout, "shutdown-timeout", s.ShutdownTimeout, "on SIGTERM, longest wait for calls in flight before connections are cut")
	fs.BoolVar(&s.DisableReflection, "disable-reflection", s.DisableReflection, "turn gRPC server reflection off")
}

// bindSweep registers the flags of sweep.
func (c *config) bindSweep(fs *flag.FlagSet) {
	c.bindCommon(fs)
	fs.IntVar(&c.Sweep.BatchSize, "batch-size", c.Sweep.BatchSize, "most records one batch deletes")
	durationVar(fs, &c.Sweep.BatchTimeout, "batch-timeout", c.Sweep.BatchTimeout, "timeout of one batch; after a timeout the batch size halves")
	offAtZeroVar(fs, &c.Sweep.Pause, policy.ParseDuration, "pause", "mean pause between batches, jittered by ±50%, to leave the store to live traffic; 0: none")
	durationVar(fs, &c.Sweep.MaxDuration, "max-duration", c.Sweep.MaxDuration, "stop starting batches after this long (exit status 3 if expired records may be left); 0 means no limit")
}

// offAtZeroVar binds a flag whose 0 turns something off to a library
// field where zero takes the default and a negative value turns it off.
func offAtZeroVar[T int | time.Duration](fs *flag.FlagSet, p *T, parse func(string) (T, error), name, usage string) {
	fs.Var(offAtZero[T]{p, parse, name}, name, usage)
}

type offAtZero[T int | time.Duration] struct {
	p     *T
	parse func(string) (T, error)
	name  string
}

func (o offAtZero[T]) Set(s string) error {
	v, err := o.parse(s)
	switch {
	case err != nil:
		return err
	case v < 0:
		return fmt.Errorf("--%s must not be negative (0 turns it off)", o.name)
	case v == 0:
		v = -1
	}
	*o.p = v
	return nil
}

func (o offAtZero[T]) Type() string {
	if _, ok := any(*new(T)).(time.Duration); ok {
		return "duration"
	}
	return "int"
}

func (o offAtZero[T]) String() string {
	if o.p == nil || *o.p < 0 {
		return "0"
	}
	if d, ok := any(*o.p).(time.Duration); ok {
		return policy.FormatDuration(d)
	}
	return fmt.Sprint(*o.p)
}

// uint32Value is a flag of a uint32 field (grpc's bounds).
type uint32Value struct{ p *uint32 }

func (u uint32Value) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 32)
	*u.p = uint32(n)
	return err
}

func (uint32Value) Type() string { return "uint" }

func (u uint32Value) String() string {
	if u.p == nil {
		return "0"
	}
	return strconv.FormatUint(uint64(*u.p), 10)
}

// Validate reports settings that cannot work together: the binary's own,
// then each library's Validate, its errors naming the flags.
func (c *config) Validate() error {
	var errs []error
	if c.Listen == "" {
		errs = append(errs, errors.New("--listen is required"))
	}
	if c.DatabaseURL == "" && c.DataDir == "" {
		errs = append(errs, errors.New("either --database-url or --data-dir is required"))
	}
	if c.DatabaseURL != "" {
		errs = append(errs, validDatabaseURL(c.DatabaseURL))
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
	errs = append(errs, c.ConsoleProxy.validate(c.ConsoleListen))
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
	switch {
	case sw.BatchSize < 1:
		errs = append(errs, fmt.Errorf("the sweep batch size must be positive, got %d", sw.BatchSize))
	case sw.BatchTimeout <= 0:
		errs = append(errs, fmt.Errorf("the sweep batch timeout must be positive, got %v", sw.BatchTimeout))
	}
	if err := sw.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("sweep: %w", err))
	}
	return errors.Join(errs...)
}

// commandLineBounds are the server's settings the command line refuses
// although the library would take them: a flag shows its default, so a
// zero given is not "the default", and is more likely meant as "no bound",
// which there is not; and the costs of counting too often.
func (c *config) commandLineBounds() []error {
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

// sweeper is the sweeper's configuration, logging to logger.
func (c *config) sweeper(logger *slog.Logger) retention.Config {
	rc := c.Sweep
	rc.Logger = logger
	return rc
}

// logger is the command's logger, which every package it wires is given:
// durations as "1m0s", and the trace and span of a traced call's lines
// (telemetry.NewLogger).
func (c *config) logger(w io.Writer) *slog.Logger {
	return telemetry.NewLogger(w, c.LogFormat, c.LogLevel)
}
