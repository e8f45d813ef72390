package server

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/keepalive"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/replicas"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/server/resulttype"
)

// Config configures a Server. Zero fields take the documented defaults.
type Config struct {
	// Limits bound requests; zero means DefaultLimits().
	Limits Limits
	// Policy, when set and File is not, gives each consumer its lease and
	// retention bounds in place of those of Limits (which should be its
	// base: see Limits.Policy). Nil means every consumer gets those of
	// Limits.
	Policy *policy.Set
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
	// HealthInterval is how often the store is pinged and probed to drive
	// the health service (default 2s); PingTimeout bounds each ping and
	// each probe (default 1s).
	HealthInterval, PingTimeout time.Duration
	// Readiness decides when failing store calls make the server
	// NOT_SERVING (health.go); zero fields take the defaults.
	Readiness Readiness
	// ShutdownTimeout bounds the graceful drain before connections are cut
	// (default 10s).
	ShutdownTimeout time.Duration
	// DisableReflection turns server reflection off (it is on by default so
	// grpcurl works out of the box).
	DisableReflection bool

	// File, when set, is the config file whose parts are the policy and
	// the access set (in place of Policy and Access), consulted on every
	// request so that a reload takes effect at once: each request reads
	// both from one snapshot, taken when it arrives, so a reload while it
	// runs cannot give it the identities of one file and the policy of
	// another. It is the one source of both (configfile.Static holds fixed
	// sets).
	File *configfile.Source
	// Access, when set and File is not, decides who may call and how often:
	// identities, their consumers and the rate limits (server/access). Nil
	// means an open set: every caller is anonymous and may use every
	// consumer, unlimited.
	Access *access.Set
	// TLS, when set, is the server's TLS configuration; with ClientAuth set
	// to RequireAndVerifyClientCert it is mTLS, and verified certificates
	// identify callers. Nil serves plaintext.
	TLS *tls.Config
	// RequestTimeout is the budget of a request that carries no deadline
	// (DefaultRequestTimeout); MaxRequestTimeout caps a request's deadline
	// (DefaultMaxRequestTimeout).
	RequestTimeout, MaxRequestTimeout time.Duration
	// MaxWaiters bounds the Claims waiting at once (ClaimRequest.wait); one
	// beyond it answers at once (DefaultMaxWaiters). WaitRecheck is how
	// often a waiter looks for changes made through other replicas
	// (DefaultWaitRecheck): their bound on how late a waiter wakes.
	MaxWaiters  int
	WaitRecheck time.Duration
	// MaxWaitersPerIdentity bounds the Claims of each identity of the
	// config file waiting at once, so that one tenant cannot take every
	// slot of MaxWaiters (nor the memory and re-checks they cost); one
	// beyond it answers at once, as beyond MaxWaiters. Zero means half of
	// MaxWaiters (DefaultWaitShare); MaxWaiters or more turns the share
	// off. An open server (no identities) has no shares.
	MaxWaitersPerIdentity int
	// QuotaRefresh is how often the usage of the consumers with a quota
	// (max_records, max_bytes) is counted in the store (DefaultQuotaRefresh;
	// quota.go): the bound on how late a replica learns of the records
	// other replicas created.
	QuotaRefresh time.Duration
	// MaxQuotaConsumersPerIdentity bounds the consumers with a quota one
	// replica follows for each identity (the one whose Claim it saw
	// first); a consumer idle for QuotaIdleRefreshes refreshes is
	// forgotten. A consumer with a quota beyond the bound is not admitted
	// unchecked: its new keys are refused, QUOTA_EXCEEDED, until the
	// identity's followed consumers fall below it
	// (DefaultMaxQuotaConsumersPerIdentity).
	MaxQuotaConsumersPerIdentity int
	// ParkedCountInterval is how often the parked records of every
	// consumer are counted in the store for the idemreg.parked_records
	// gauge (DefaultParkedCountInterval; parked.go): how late the gauge
	// may be. Negative turns the gauge off.
	ParkedCountInterval time.Duration
	// MaxInFlight bounds the store operations in flight; a call beyond it
	// fails at once with UNAVAILABLE, reason OVERLOADED (DefaultMaxInFlight).
	MaxInFlight int
	// MaxInFlightPerIdentity bounds the store operations in flight of each
	// identity of the config file, so that one tenant cannot take every
	// slot of MaxInFlight; a call beyond it fails like one beyond
	// MaxInFlight, with a QuotaFailure naming the identity. Zero means half
	// of MaxInFlight (DefaultInFlightShare); MaxInFlight or more turns the
	// share off. An open server (no identities) has no shares.
	MaxInFlightPerIdentity int
	// StreamWorkers is how many long-lived goroutines run calls
	// (DefaultStreamWorkers); a call that finds none idle gets a goroutine
	// of its own, as every call does when it is negative. Reused
	// goroutines keep the stacks they grew, which a new goroutine per call
	// grows again by copying: an eighth of the server's CPU under load.
	StreamWorkers int
	// StaticWindow fixes the HTTP/2 flow-control window of every stream
	// and every connection of the gRPC listener at this many bytes
	// (DefaultStaticWindow); negative leaves grpc-go's dynamic windows,
	// which it sizes by estimating the bandwidth-delay product: a PING and
	// its ack with nearly every small message it receives
	// (grpc/grpc-go#6998), about a quarter of the server's CPU per call
	// at 8 callers (docs/benchmarks.md, issue 36).
	StaticWindow int
	// Keepalive sets connection ages and pings; zero fields take the
	// defaults of DefaultKeepalive.
	Keepalive keepalive.ServerParameters
	// Bounds limit what any peer that can connect may make the server
	// hold (headers, streams, connections), on the gRPC listener and the
	// health listener alike; zero fields take the defaults of
	// DefaultBounds.
	Bounds Bounds
	// RefusalLogRate is how many access log lines a second are written for
	// each identity and refusal code (UNAUTHENTICATED, PERMISSION_DENIED,
	// RESOURCE_EXHAUSTED, INVALID_ARGUMENT); the others are counted, not
	// written (accesslog.go). Zero means DefaultRefusalLogRate; negative
	// writes every line.
	RefusalLogRate int
	// RefusalRate is how many refusals (UNAUTHENTICATED,
	// PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT) a second
	// each caller may draw, an identity or, for a caller without one, a
	// source address, before each further one is answered only after
	// RefusalDelay (refusals.go); serve's default is DefaultRefusalRate.
	// Zero or negative holds none.
	RefusalRate float64
	// RefusalDelay is how long a refusal beyond RefusalRate is held, at
	// most half of what is left of the call's deadline (zero:
	// DefaultRefusalDelay).
	RefusalDelay time.Duration
	// DrainDelay is how long the server keeps serving after reporting
	// NOT_SERVING on shutdown, so load balancers and Kubernetes endpoints
	// stop sending new calls before connections are drained (default 0).
	DrainDelay time.Duration
	// MeterProvider and TracerProvider receive the registry's and
	// otelgrpc's metrics and spans; nil means the global providers.
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	// ClaimKeyRefresh is how often the claim keys are re-read from the
	// store (DefaultClaimKeyRefresh): the bound on how late this
	// replica learns of a rotation (idemreg rotate-claim-key), besides the
	// one read a secret that verifies under no known key causes, at most
	// once per interval.
	ClaimKeyRefresh time.Duration
	// Now is the clock the claim keys' activation and grace are compared
	// with; nil means time.Now. Replicas' clocks need only agree to well
	// within a rotation's activation delay.
	Now func() time.Time
	// Replica places this replica among those sharing the store
	// (server/internal/replicas): its ID, the address its peers reach it on, its
	// heartbeat. Zero fields take the defaults.
	Replica Replica
	// ResultTypes are the message types whose responses ResolveRecord
	// checks before storing them and encodes from JSON: those of an
	// operator's descriptor set (resulttype.Load) beside the linked ones.
	// Nil: the types linked into the binary only.
	ResultTypes *resulttype.Types
}

// DefaultMaxInFlight is the default bound on store operations in flight:
// well above what a store answers at once (a PostgreSQL pool holds tens of
// connections), well below what makes every queued call miss its deadline.
const DefaultMaxInFlight = 256

// DefaultInFlightShare is the share of MaxInFlight an identity may take
// by default: half, so that a single tenant flooding the server, or
// waiting on its own slow keys, always leaves the other half to everyone
// else, while a lone busy tenant still gets most of the server.
const DefaultInFlightShare = 0.5

// DefaultStreamWorkers is the default number of goroutines that run calls:
// enough for the callers a replica serves at once, so that nearly every
// call finds one idle, at a few KiB of stack each.
const DefaultStreamWorkers = 128

// MinStaticWindow is the smallest StaticWindow: HTTP/2's initial window,
// below which grpc-go ignores the setting.
const MinStaticWindow = 64 << 10

// DefaultStaticWindow is the default StaticWindow: what grpc-go's dynamic
// windows start from, enough for a batch of small items in one window,
// while a request of several MiB (MaxRequestBytes) takes a few window
// updates on its way in.
const DefaultStaticWindow = 1 << 20

// DefaultKeepalive are the connection settings for load-balanced
// deployments: connections are recycled every few minutes so that new
// replicas get their share of long-lived clients, with a grace longer than
// the longest request; idle connections are closed; pings detect dead
// peers behind NATs and proxies.
func DefaultKeepalive() keepalive.ServerParameters {
	return keepalive.ServerParameters{
		MaxConnectionIdle:     5 * time.Minute,
		MaxConnectionAge:      5 * time.Minute,
		MaxConnectionAgeGrace: DefaultMaxRequestTimeout + 5*time.Second,
		Time:                  time.Minute,
		Timeout:               20 * time.Second,
	}
}

// keepaliveEnforcement lets clients ping every 10 s, with or without calls
// in flight, without being disconnected for it.
var keepaliveEnforcement = keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}

func (c *Config) setDefaults() {
	if c.Limits == (Limits{}) {
		c.Limits = DefaultLimits()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.HealthInterval <= 0 {
		c.HealthInterval = 2 * time.Second
	}
	if c.PingTimeout <= 0 {
		c.PingTimeout = time.Second
	}
	if c.ShutdownTimeout <= 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = DefaultRequestTimeout
	}
	if c.MaxRequestTimeout <= 0 {
		c.MaxRequestTimeout = DefaultMaxRequestTimeout
	}
	if c.QuotaRefresh <= 0 {
		c.QuotaRefresh = DefaultQuotaRefresh
	}
	if c.ParkedCountInterval == 0 {
		c.ParkedCountInterval = DefaultParkedCountInterval
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxInFlightPerIdentity <= 0 {
		c.MaxInFlightPerIdentity = max(1, int(float64(c.MaxInFlight)*DefaultInFlightShare))
	}
	if c.RefusalLogRate == 0 {
		c.RefusalLogRate = DefaultRefusalLogRate
	}
	if c.RefusalDelay <= 0 {
		c.RefusalDelay = DefaultRefusalDelay
	}
	if c.StreamWorkers == 0 {
		c.StreamWorkers = DefaultStreamWorkers
	}
	if c.StaticWindow == 0 {
		c.StaticWindow = DefaultStaticWindow
	}
	def := DefaultKeepalive()
	k := &c.Keepalive
	for _, f := range []struct{ v, d *time.Duration }{
		{&k.MaxConnectionIdle, &def.MaxConnectionIdle}, {&k.MaxConnectionAge, &def.MaxConnectionAge},
		{&k.MaxConnectionAgeGrace, &def.MaxConnectionAgeGrace}, {&k.Time, &def.Time}, {&k.Timeout, &def.Timeout},
	} {
		if *f.v <= 0 {
			*f.v = *f.d
		}
	}
	c.Bounds.setDefaults()
	c.Readiness.setDefaults()
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
}

// ClaimSecretSize is the length of a claim secret (server/internal/claimsecret).
const ClaimSecretSize = claimsecret.Size

// DefaultClaimKeyRefresh is how often a server re-reads the claim keys by
// default: the bound on how late it learns of a rotation, which
// `idemreg rotate-claim-key`'s activation delay must exceed.
const DefaultClaimKeyRefresh = claimsecret.DefaultRefresh

// Quotas' defaults (server/internal/quota): how often a replica counts the
// usage of the consumers with a quota; how many of them it follows for one
// identity; how many refreshes a consumer may go without a Claim before it
// is forgotten.
const (
	DefaultQuotaRefresh                 = quota.DefaultRefresh
	DefaultMaxQuotaConsumersPerIdentity = quota.DefaultMaxConsumersPerIdentity
	QuotaIdleRefreshes                  = quota.IdleRefreshes
)

// A ConfigError is a field of Config whose value cannot work. Field names
// it as Config does ("WaitRecheck", "Keepalive.MaxConnectionAge"), so that
// a program that sets the fields from flags or a file can name its own
// setting instead.
type ConfigError struct {
	Field   string
	Value   any
	Problem string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("%s %s, got %v", e.Field, e.Problem, e.Value)
}

// Validate reports the settings of c that cannot work, each field's as a
// *ConfigError; Limits, Bounds and Readiness report theirs through their
// own Validate. Zero fields are valid, as they take the defaults, and so
// are the negative values documented to turn something off
// (ParkedCountInterval, StreamWorkers, StaticWindow). New calls it.
func (c Config) Validate() error {
	var errs []error
	bad := func(field string, value any, problem string) {
		errs = append(errs, &ConfigError{Field: field, Value: value, Problem: problem})
	}
	if c.Limits != (Limits{}) {
		errs = append(errs, c.Limits.Validate())
	}
	k := c.Keepalive
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"HealthInterval", c.HealthInterval}, {"PingTimeout", c.PingTimeout},
		{"RequestTimeout", c.RequestTimeout}, {"MaxRequestTimeout", c.MaxRequestTimeout},
		{"WaitRecheck", c.WaitRecheck}, {"QuotaRefresh", c.QuotaRefresh},
		{"DrainDelay", c.DrainDelay}, {"ShutdownTimeout", c.ShutdownTimeout},
		{"Keepalive.MaxConnectionIdle", k.MaxConnectionIdle}, {"Keepalive.MaxConnectionAge", k.MaxConnectionAge},
		{"Keepalive.MaxConnectionAgeGrace", k.MaxConnectionAgeGrace}, {"Keepalive.Time", k.Time}, {"Keepalive.Timeout", k.Timeout},
	} {
		if d.v < 0 {
			bad(d.field, d.v, "must not be negative")
		}
	}
	for _, n := range []struct {
		field string
		v     int
	}{{"MaxInFlight", c.MaxInFlight}, {"MaxInFlightPerIdentity", c.MaxInFlightPerIdentity}, {"MaxWaiters", c.MaxWaiters},
		{"MaxWaitersPerIdentity", c.MaxWaitersPerIdentity}, {"MaxQuotaConsumersPerIdentity", c.MaxQuotaConsumersPerIdentity}} {
		if n.v < 0 {
			bad(n.field, n.v, "must not be negative")
		}
	}
	// grpc-go ignores a window below HTTP/2's initial one, and the
	// server would run with dynamic windows while configured for static.
	if c.StaticWindow > 0 && (c.StaticWindow < MinStaticWindow || c.StaticWindow > math.MaxInt32) {
		bad("StaticWindow", c.StaticWindow, fmt.Sprintf("must be between %d and %d bytes, or off (grpc-go's dynamic windows)", MinStaticWindow, math.MaxInt32))
	}
	// A deadline cut to below the budget of a request without one would
	// make a caller's explicit deadline shorter than not giving any.
	if c.RequestTimeout >= 0 && c.MaxRequestTimeout >= 0 {
		budget := cmp.Or(c.RequestTimeout, DefaultRequestTimeout)
		if most := cmp.Or(c.MaxRequestTimeout, DefaultMaxRequestTimeout); most < budget {
			bad("MaxRequestTimeout", most, fmt.Sprintf("must be at least the request timeout (%v)", budget))
		}
	}
	// Below a millisecond a waiter spins on the store; above MaxWait it
	// would never look before its wait ends.
	if w := c.WaitRecheck; w > 0 && (w < time.Millisecond || w > MaxWait) {
		bad("WaitRecheck", w, fmt.Sprintf("must be between 1ms and %v, the longest wait", MaxWait))
	}
	// NaN would compare false to every bound and make a bucket of no
	// size; an infinite rate is no budget, which zero says.
	if math.IsNaN(c.RefusalRate) || math.IsInf(c.RefusalRate, 0) {
		bad("RefusalRate", c.RefusalRate, "must be a finite number (0 holds no refusal)")
	}
	c.Replica.validate(bad)
	errs = append(errs, c.Bounds.Validate(), c.Readiness.Validate())
	return errors.Join(errs...)
}

// Replicas sharing a store find each other through it: each heartbeats a
// row with its ID and the address its peers reach it on, when the store
// keeps a membership (storage.Membership; both backends do, the embedded
// one trivially); server/internal/replicas keeps this replica's place
// among them. docs/operations.md, "Replicas", says how to set the address
// up.

// Defaults of Replica.
const (
	DefaultHeartbeat = replicas.DefaultHeartbeat
	DefaultLiveFor   = replicas.DefaultLiveFor
)

// Replica is this replica's place in the membership.
type Replica struct {
	// ID names this replica in the membership; empty: a new one for each
	// run of the process (the host name and random bytes).
	ID string
	// AdvertiseAddress is host:port, where the other replicas reach this
	// one's gRPC listener. Empty: the listener's address, unless its host
	// is unspecified (0.0.0.0, ::), when the host name replaces it. In
	// Kubernetes, give the pod's IP (the downward API's status.podIP) and
	// the port.
	AdvertiseAddress string
	// HeartbeatInterval is how often the replica writes its heartbeat and reads
	// its peers (DefaultHeartbeat); MemberLiveFor is how old a heartbeat may be,
	// by the store's clock, for its replica to count as live
	// (DefaultLiveFor), more than HeartbeatInterval.
	HeartbeatInterval, MemberLiveFor time.Duration
}

func (r Replica) validate(bad func(field string, value any, problem string)) {
	if r.HeartbeatInterval < 0 {
		bad("Replica.HeartbeatInterval", r.HeartbeatInterval, "must not be negative")
	}
	if r.MemberLiveFor < 0 {
		bad("Replica.MemberLiveFor", r.MemberLiveFor, "must not be negative")
	}
	beat, live := cmp.Or(r.HeartbeatInterval, DefaultHeartbeat), cmp.Or(r.MemberLiveFor, DefaultLiveFor)
	if r.HeartbeatInterval >= 0 && r.MemberLiveFor >= 0 && live <= beat {
		bad("Replica.MemberLiveFor", live, fmt.Sprintf("must be more than the heartbeat interval (%v)", beat))
	}
	if a := r.AdvertiseAddress; a != "" {
		if _, _, err := net.SplitHostPort(a); err != nil {
			bad("Replica.AdvertiseAddress", a, "must be host:port")
		}
	}
}
