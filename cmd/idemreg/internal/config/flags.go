package config

import (
	"flag"
	"slices"
	"strconv"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sharedport"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/policy"
)

// ServeFlags declares each flag of serve once (cmdline.Flag): its group in
// -h, the groups and flags in the order an operator meets them, its help,
// and the field it sets, whose value in Default is its default. Its
// environment variable is named after it (cmdline.EnvName). The server's
// flags are named after the fields they set (MaxInFlight is
// --max-in-flight), so that its errors name them (named).
func (c *Config) ServeFlags() []cmdline.Flag {
	s, l, b, r, h := &c.Server, &c.Server.Limits, &c.Server.Bounds, &c.Server.Readiness, &c.HTTP
	return slices.Concat(
		cmdline.Group("Listeners and TLS",
			cmdline.String(&c.Listen, "listen", "gRPC listen address"),
			cmdline.String(&c.TLS.CertFile, "tls-cert", "PEM certificate chain of the server; with --tls-key, serve TLS (files are re-read when they change)"),
			cmdline.String(&c.TLS.KeyFile, "tls-key", "PEM private key of --tls-cert"),
			cmdline.String(&c.TLS.ClientCAFile, "tls-client-ca", "PEM CAs of client certificates: every client must present one they sign (mTLS); identities match its URI SAN, DNS SAN or subject"),
			cmdline.Bool(&c.Plaintext, "plaintext", "serve without TLS on an address that is not loopback (behind a mesh that encrypts)"),
			cmdline.Bool(&c.DisableHTTPAPI, "disable-http-api", "answer only gRPC on --listen: no Connect protocol, gRPC-Web or HTTP/JSON (HTTP/1.1) beside it"),
			cmdline.String(&c.HTTPAPICORSOrigins, "http-api-cors-origins", "browser origins (https://app.example.com, comma-separated, or *) whose pages may call the HTTP API on --listen; empty: none but the same origin"),
			cmdline.String(&c.HealthListen, "health-listen", "serve grpc.health.v1 alone, in plaintext, on this address, for Kubernetes gRPC probes (off when empty)"),
			cmdline.Bool(&s.DisableReflection, "disable-reflection", "turn gRPC server reflection off")),
		cmdline.Group("Authentication and the config file",
			cmdline.String(&c.PolicyFile, "config", "config file (YAML or JSON): retention policy (defaults and per-consumer lease and retention bounds, over the flags below), identities and rate limits; reloaded, whole or not at all, when it changes on disk (checked every --config-poll) and on SIGHUP"),
			cmdline.Duration(&c.ConfigPoll, "config-poll", "how often --config is read for a change on disk (a ConfigMap update, an edit); 0: only SIGHUP reloads it"),
			cmdline.Bool(&c.AllowUnauthenticated, "allow-unauthenticated", "serve an address that is not loopback without identities in --config: every caller may use every consumer"),
			cmdline.String(&c.DescriptorSet, "descriptor-set", "binary FileDescriptorSet (buf build -o FILE.binpb, protoc --include_imports --descriptor_set_out=FILE) of the services' response types: a resolution's response of one of them must decode as it, and may be given as JSON (the google.protobuf types are known without it); read at start")),
		cmdline.Group("Store", append(c.StoreFlags(),
			cmdline.Int64(&c.DataDirReserve, "data-dir-reserve", "free bytes the embedded store keeps on its file system: below it Claims that would start an attempt are refused (RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED), below half of it results over 64 KiB too; 0: 256 MiB or a quarter of the file system, whichever is less; negative: none"),
			cmdline.Int(&c.SQLBatchSize, "sql-batch-size", "SQL store: how many queued Claims and Completes are sent as one batch without waiting for a slot (--sql-batch-slots); 1 sends each unary call alone"),
			cmdline.Duration(&c.SQLBatchWindow, "sql-batch-window", "SQL store: longest a queued Claim or Complete waits for a statement slot before its batch is sent anyway"),
			cmdline.Int(&c.SQLBatchSlots, "sql-batch-slots", "SQL store: transactions in flight at once, one count for Claims and Completes together; beyond it calls queue into batches"))...),
		cmdline.Group("Leases and retention (the defaults and bounds --config's policy overrides)",
			cmdline.Duration(&l.DefaultLease, "default-lease", "lease of a Claim or Extend that gives none"),
			cmdline.Duration(&l.MinLease, "min-lease", "smallest lease a request may ask for"),
			cmdline.Duration(&l.MaxLease, "max-lease", "largest lease a request may ask for"),
			cmdline.Duration(&l.MaxLeaseTotal, "max-lease-total", "longest one attempt may hold a key, its Claim's lease and every Extend together (at least --max-lease; 0: no bound)"),
			cmdline.Duration(&l.DefaultMessageRetention, "default-message-retention", "retention of a KIND_MESSAGE Claim that gives none"),
			cmdline.Duration(&l.DefaultOperationRetention, "default-operation-retention", "retention of a KIND_OPERATION Claim that gives none"),
			cmdline.Duration(&l.MinRetention, "min-retention", "smallest retention a request may ask for"),
			cmdline.Duration(&l.MaxRetention, "max-retention", "largest retention a request may ask for"),
			cmdline.Int(&l.MaxResultBytes, "max-result-bytes", "largest encoded result Complete accepts")),
		cmdline.Group("Request limits",
			cmdline.Duration(&s.RequestTimeout, "request-timeout", "budget of a request that carries no deadline"),
			cmdline.Duration(&s.MaxRequestTimeout, "max-request-timeout", "longest deadline a request may carry; longer ones are cut to it"),
			cmdline.Int(&s.MaxInFlight, "max-in-flight", "most store operations at once; beyond it calls fail at once with UNAVAILABLE (OVERLOADED)"),
			cmdline.Int(&s.MaxInFlightPerIdentity, "max-in-flight-per-identity", "most store operations at once of one identity of --config, so one tenant cannot take every slot (0: half of --max-in-flight; --max-in-flight turns it off)"),
			cmdline.Int(&b.MaxCallsPerIdentity, "max-calls-per-identity", "most calls one identity of --config has in progress at once; beyond it they fail with RESOURCE_EXHAUSTED (TOO_MANY_CALLS)"),
			cmdline.Int(&s.MaxQuotaConsumersPerIdentity, "max-quota-consumers-per-identity", "most consumers with a quota (max_records, max_bytes in --config) a replica follows for one identity; beyond it their new keys are refused (QUOTA_EXCEEDED) until one of its consumers is idle for "+strconv.Itoa(server.QuotaIdleRefreshes)+" quota refreshes"),
			cmdline.Duration(&s.QuotaRefresh, "quota-refresh", "how often the live records and bytes of the consumers with a quota (max_records, max_bytes in --config) are counted in the store: how late a replica learns of other replicas' new keys"),
			cmdline.OffAtZero(&s.StreamWorkers, strconv.Atoi, "stream-workers", "goroutines kept to run calls, reusing their stacks (0: a new goroutine per call)"),
			cmdline.Float64(&s.RefusalRate, "refusal-rate", "refusals (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT) a second each caller may draw, an identity or, without one, a source IP, before each further one is answered only after --refusal-delay (burst: twice it; 0: never held); idemreg_refusals_slowed_total counts them"),
			cmdline.Duration(&s.RefusalDelay, "refusal-delay", "how long a refusal beyond --refusal-rate is held before it is answered (at most half of what is left of the call's deadline)")),
		cmdline.Group("Waiting Claims",
			cmdline.Int(&s.MaxWaiters, "max-waiters", "most Claims waiting at once for a key in progress (ClaimRequest.wait); beyond it a Claim answers at once"),
			cmdline.Int(&s.MaxWaitersPerIdentity, "max-waiters-per-identity", "most Claims of one identity of --config waiting at once, so one tenant cannot take every wait slot (0: half of --max-waiters; --max-waiters turns it off)"),
			cmdline.Duration(&s.WaitRecheck, "wait-recheck", "how often a waiting Claim looks for changes made through other replicas: how late it may wake for them")),
		cmdline.Group("Replicas (membership, waits across replicas)",
			cmdline.String(&s.Replica.AdvertiseAddress, "advertise-address", "host:port where the other replicas reach this one's --listen, written to the store's membership (empty: --listen, or the host name and its port when its host is 0.0.0.0 or [::]; in Kubernetes, the pod IP from the downward API)"),
			cmdline.Duration(&s.Replica.HeartbeatInterval, "heartbeat-interval", "how often this replica writes its heartbeat to the store's membership and reads the other replicas"),
			cmdline.Duration(&s.Replica.MemberLiveFor, "member-live-for", "how old a replica's heartbeat may be, by the store's clock, for the others to count it as live (more than --heartbeat-interval)")),
		cmdline.Group("Connections",
			cmdline.Int(&b.MaxConnections, "max-connections", "most connections each listener (gRPC, health) holds open; beyond it new ones wait to be accepted"),
			cmdline.Uint32(&b.MaxConcurrentStreams, "max-concurrent-streams", "most calls open at once on one connection; clients queue beyond it"),
			cmdline.Int(&b.MaxPendingCalls, "max-pending-calls", "most calls whose request message has not arrived yet, both listeners (gRPC, health) together, half on each; beyond it they fail at once with RESOURCE_EXHAUSTED (TOO_MANY_STREAMS), before credentials are checked"),
			cmdline.Int(&b.MaxPublicStreams, "max-public-streams", "most health Watch and reflection streams (which need no credentials) open at once; beyond it they fail with RESOURCE_EXHAUSTED"),
			cmdline.Uint32(&b.MaxHeaderListSize, "max-header-list-size", "largest header list of one call, in bytes (names, values and 32 bytes per field); a call over it is refused before any handler"),
			cmdline.Duration(&b.ConnectionTimeout, "connection-timeout", "longest a new connection may take over its TLS and HTTP/2 handshakes"),
			cmdline.Duration(&s.Keepalive.MaxConnectionAge, "max-connection-age", "close client connections after about this long (clients reconnect, so load spreads over new replicas)"),
			cmdline.Duration(&s.Keepalive.MaxConnectionIdle, "max-connection-idle", "close client connections that have had no call for this long"),
			cmdline.Int(&c.MaxConnectingPerSource, "max-connecting-per-source", "most connections of one source IP on --listen whose first bytes (TLS ClientHello, HTTP/2 preface or HTTP/1.1 request) have not arrived yet, of the "+strconv.Itoa(sharedport.MaxSniffing)+" at once; beyond it its new ones are closed at once, so that a source that connects and sends nothing keeps no other waiting"),
			cmdline.Int(&b.MaxHealthConnectionsPerSource, "max-health-connections-per-source", "most connections one source IP holds open on --health-listen, of its --max-connections; beyond it its new ones are closed at once, so that a flood from one source leaves the kubelet's probes a slot"),
			cmdline.OffAtZero(&s.StaticWindow, strconv.Atoi, "static-window", "the HTTP/2 flow-control window of every stream and connection of --listen, fixed, in bytes (at least 65536), so that grpc-go sends no bandwidth-estimating PING with each small message it receives; clients should dial with the same (grpc.WithStaticStreamWindowSize, WithStaticConnWindowSize) (0: grpc-go's dynamic windows)")),
		cmdline.Group("Retention sweeper",
			cmdline.Duration(&c.Sweep.Interval, "sweep-interval", "time between sweeps of expired records; 0 turns the in-process sweeper off"),
			cmdline.Int(&c.Sweep.BatchSize, "sweep-batch-size", "most records one sweep batch deletes"),
			cmdline.Duration(&c.Sweep.BatchTimeout, "sweep-batch-timeout", "timeout of one sweep batch (the batch halves after one)")),
		cmdline.Group("Health, readiness and shutdown",
			cmdline.Int(&r.Window, "readiness-window", "health intervals (2 s each) over which the store calls' failure rate decides readiness"),
			cmdline.Int(&r.MinCalls, "readiness-min-calls", "fewest store calls in the readiness window for their failure rate to count"),
			cmdline.Float64(&r.MaxFailureRatio, "readiness-max-failure-ratio", "share of failed store calls in the readiness window, in (0, 1], at which serve reports NOT_SERVING"),
			cmdline.Duration(&s.DrainDelay, "drain-delay", "on SIGTERM, keep serving this long after health turns NOT_SERVING, for load balancers to notice"),
			cmdline.Duration(&s.ShutdownTimeout, "shutdown-timeout", "on SIGTERM, longest wait for calls in flight before connections are cut")),
		cmdline.Group("Telemetry and logs", slices.Concat([]cmdline.Flag{
			cmdline.String(&c.MetricsListen, "metrics-listen", "serve Prometheus metrics on http://ADDR/metrics (off when empty)")}, c.LogFlags(), []cmdline.Flag{
			cmdline.OffAtZero(&s.RefusalLogRate, strconv.Atoi, "refusal-log-rate", "access log lines written a second for each identity and refusal code (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT); the others are counted in idemreg_access_log_sampled_out_total (0: every line)"),
			cmdline.OffAtZero(&s.ParkedCountInterval, policy.ParseDuration, "parked-count-interval", "how often the parked records of every consumer are counted in the store (from its index of parked records) for the idemreg_parked_records gauge; 0 turns the gauge off")})...),
		cmdline.Group("Operator console",
			cmdline.String(&c.ConsoleListen, "console-listen", "serve the operator console (status, records to list, inspect, resolve and invalidate, one by one or many at once, as the signed-in operator) on this address; loopback only unless --console-allow-remote (off when empty)"),
			cmdline.Bool(&c.ConsoleAllowRemote, "console-allow-remote", "allow --console-listen on an address that is not loopback: the console speaks plaintext HTTP, so sign-in tokens and records cross the network unencrypted"),
			cmdline.String(&c.ConsoleProxy.Header, "console-proxy-header", "sign console operators in from this header of a trusted reverse proxy (X-Forwarded-Email or X-Auth-Request-User of oauth2-proxy; an identity-aware proxy's user header), believed only with the proxy's secret (--console-proxy-secret-file); off when empty, and the header is then ignored"),
			cmdline.String(&c.ConsoleProxy.Users, "console-proxy-user", "USER=IDENTITY,... maps the proxy header's users to identities of --config (USER is exact, *@DOMAIN or *); needed with --console-proxy-header"),
			cmdline.String(&c.ConsoleProxy.SecretFile, "console-proxy-secret-file", "file holding the secret (at least "+strconv.Itoa(console.MinProxySecretSize)+" bytes: openssl rand -hex 32) the proxy sends in its "+console.ProxySecretHeader+" header on every request; needed with --console-proxy-header, since a source address proves nothing (kubectl port-forward and ssh -L arrive on loopback); read at start"),
			cmdline.String(&c.ConsoleProxy.From, "console-proxy-from", "the proxy's source addresses (CIDR or address, comma-separated): --console-proxy-header is refused from any other, the secret notwithstanding; empty: from any address that sends the secret")),
		cmdline.Group("HTTP listeners (metrics, console, pprof, and the HTTP API's side of --listen)",
			cmdline.Int(&h.MaxConnections, "http-max-connections", "most connections each HTTP listener (metrics, console, pprof, the HTTP API) holds open; at it a new one takes the place of an idle one, or is closed at once if none is idle"),
			cmdline.Int(&h.MaxConnectionsPerSource, "http-max-connections-per-source", "most connections one source IP holds open on each HTTP listener; at it its new one takes the place of one of its idle ones, or is closed at once if none is idle"),
			cmdline.Duration(&h.MaxConnectionAge, "http-max-connection-age", "HTTP listeners: a kept-alive connection idle after this long is closed (each request renews --http-idle-timeout)"),
			cmdline.Duration(&h.ReadHeaderTimeout, "http-read-header-timeout", "HTTP listeners: longest a request's headers, or a new connection's first request, may take to arrive"),
			cmdline.Duration(&h.ReadTimeout, "http-read-timeout", "HTTP listeners: longest a whole request, body included, may take to arrive"),
			cmdline.Duration(&h.WriteTimeout, "http-write-timeout", "HTTP listeners: longest a response may take, from the end of the request's headers (a pprof profile or trace may ask for at most this long)"),
			cmdline.Duration(&h.IdleTimeout, "http-idle-timeout", "HTTP listeners: how long a kept-alive connection may wait for its next request"),
			cmdline.Int(&h.MaxHeaderBytes, "http-max-header-bytes", "HTTP listeners: largest request headers, in bytes")),
		cmdline.Group("Profiling",
			cmdline.String(&c.PprofListen, "pprof-listen", "serve net/http/pprof on this loopback address, without authentication (off when empty)"),
			cmdline.Bool(&c.PprofAllowRemote, "pprof-allow-remote", "allow --pprof-listen on an address that is not loopback: anyone who reaches it can profile the process")),
	)
}

// StoreFlags and LogFlags are the flags serve, sweep and rotate-claim-key
// share: the store and the logs.
func (c *Config) StoreFlags() []cmdline.Flag {
	return []cmdline.Flag{
		cmdline.String(&c.DatabaseURL, "database-url", "PostgreSQL or CockroachDB URL (postgres://...); empty uses the embedded store in --data-dir"),
		cmdline.String(&c.DataDir, "data-dir", "directory of the embedded store, used when --database-url is empty"),
	}
}

func (c *Config) LogFlags() []cmdline.Flag {
	return []cmdline.Flag{
		cmdline.Text(&c.LogLevel, "log-level", "log level: debug, info, warn, error"),
		cmdline.String(&c.LogFormat, "log-format", "log format: json or text"),
	}
}

// BindServe registers the flags of serve.
func (c *Config) BindServe(fs *flag.FlagSet) { cmdline.Bind(fs, c.ServeFlags()...) }

// BindSweep registers the flags of sweep: serve's sweeper's under the
// names of a command that does nothing else.
func (c *Config) BindSweep(fs *flag.FlagSet) {
	cmdline.Bind(fs, slices.Concat(c.StoreFlags(), c.LogFlags(), []cmdline.Flag{
		cmdline.Int(&c.Sweep.BatchSize, "batch-size", "most records one batch deletes"),
		cmdline.Duration(&c.Sweep.BatchTimeout, "batch-timeout", "timeout of one batch; after a timeout the batch size halves"),
		cmdline.OffAtZero(&c.Sweep.Pause, policy.ParseDuration, "pause", "mean pause between batches, jittered by ±50%, to leave the store to live traffic; 0: none"),
		cmdline.Duration(&c.Sweep.MaxDuration, "max-duration", "stop starting batches after this long (exit status 3 if expired records may be left); 0 means no limit"),
	})...)
}
