package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// Config configures a Server. Zero fields take the documented defaults.
type Config struct {
	// Limits bound requests; zero means DefaultLimits().
	Limits Limits
	// Policy, when set, gives each consumer its lease and retention
	// bounds in place of those of Limits (which should be its base: see
	// Limits.Policy), and is consulted on every request, so a reload takes
	// effect at once. Nil means every consumer gets those of Limits.
	Policy *policy.Source
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
	// HealthInterval is how often the store is pinged and probed to drive
	// the health service (default 2s); PingTimeout bounds each ping and
	// each probe (default 1s).
	HealthInterval, PingTimeout time.Duration
	// Readiness decides when failing store calls make the server
	// NOT_SERVING (readiness.go); zero fields take the defaults.
	Readiness Readiness
	// ShutdownTimeout bounds the graceful drain before connections are cut
	// (default 10s).
	ShutdownTimeout time.Duration
	// DisableReflection turns server reflection off (it is on by default so
	// grpcurl works out of the box).
	DisableReflection bool

	// File, when set, is the config file whose parts are the Policy and
	// the Access (which it replaces): each request then reads both from
	// one snapshot, taken when it arrives, so a reload while it runs
	// cannot give it the identities of one file and the policy of another.
	File *configfile.Source
	// Access decides who may call and how often: identities, their
	// consumers and the rate limits (server/access), consulted on every
	// request so a reload takes effect at once. Nil means an open set:
	// every caller is anonymous and may use every consumer, unlimited.
	Access *access.Source
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
	if c.Access == nil {
		c.Access = access.Static(access.Open())
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
	if c.StreamWorkers == 0 {
		c.StreamWorkers = DefaultStreamWorkers
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

// Server is the gRPC server of the registry: the RegistryService, the
// AdminService, health (SERVING only while the store answers) and
// reflection.
type Server struct {
	cfg Config
	// store is the backend, for health and the parked gauge, which are
	// not a request's calls; the services call it through their store
	// chain (server/internal/storechain).
	store   storage.Store
	svc     *Service
	grpc    *grpc.Server
	health  *health.Server
	metrics *metrics
	limiter *access.Limiter
	// accessLog writes a line per finished call (accesslog.go).
	accessLog accessLogger
	// policies is the service's, for the requests' snapshots.
	policies *policy.Source
	// done is closed when Serve returns; ServeHealth stops then.
	done chan struct{}
	// serving is the last status set; only Serve's health loop touches it.
	serving healthpb.HealthCheckResponse_ServingStatus
	// public bounds the streams that need no credentials, on both
	// listeners together.
	public *publicStreams
	// identityCalls bounds the calls in progress of each identity.
	identityCalls *identityCalls
	// listeners are the bounded listeners, by name, once serving: read by
	// the connections gauge.
	listeners sync.Map // "grpc", "health" → *limitListener
	// parked is the last count of parked records, for the gauge.
	parked *parkedCounts
	// outcomes counts the service's store calls for readiness; window
	// (health loop only) keeps the last intervals' counts.
	outcomes *callOutcomes
	window   *readinessWindow
}

// healthServices are the names the health service reports readiness on:
// the whole server ("") and the registry's services.
var healthServices = []string{"", idemregv1.RegistryService_ServiceDesc.ServiceName, idemregv1.AdminService_ServiceDesc.ServiceName}

// LivenessService is the health service name that reports SERVING while the
// process runs, whatever the store does: a liveness probe that failed with
// the database would restart every replica at once and fix nothing.
const LivenessService = "liveness"

// New builds a Server on store.
func New(store storage.Store, cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	if cfg.File != nil {
		cfg.Access, cfg.Policy = cfg.File.Access(), cfg.File.Policy()
	}
	cfg.setDefaults()
	m, err := newMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	outcomes := &callOutcomes{}
	chain, err := storechain.New(store, storechain.Config{MaxInFlight: cfg.MaxInFlight, PerIdentity: cfg.MaxInFlightPerIdentity,
		Meter: m.meter, Identity: waitShare, Outcome: outcomes.record})
	if err != nil {
		return nil, err
	}
	svc, err := newService(chain, cfg.Limits, cfg.Policy, cfg.Logger, m, serviceBounds{
		maxWaiters: cfg.MaxWaiters, maxWaitersPerIdentity: cfg.MaxWaitersPerIdentity, recheck: cfg.WaitRecheck,
		maxQuotaConsumersPerIdentity: cfg.MaxQuotaConsumersPerIdentity,
		claimKeyRefresh:              cfg.ClaimKeyRefresh, now: cfg.Now,
	})
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg: cfg, store: store, svc: svc, metrics: m, limiter: access.NewLimiter(nil), policies: svc.policies, done: make(chan struct{}),
		accessLog:     accessLogger{logger: cfg.Logger, m: m},
		public:        newPublicStreams(cfg.Bounds.MaxPublicStreams, m),
		identityCalls: &identityCalls{max: int64(cfg.Bounds.MaxCallsPerIdentity), m: m},
		outcomes:      outcomes,
		window:        newReadinessWindow(cfg.Readiness),
		// The backend counts: the gauge's count is not a request's store call.
		parked: newParkedCounts(store, cfg.Logger),
	}
	if cfg.RefusalLogRate > 0 {
		s.accessLog.refusals = newRefusalSampler(cfg.RefusalLogRate)
	}
	if _, err := m.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		s.listeners.Range(func(name, l any) bool {
			obs.ObserveInt64(m.connections, l.(*limitListener).open(), metric.WithAttributes(attribute.String("listener", name.(string))))
			return true
		})
		return nil
	}, m.connections); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	if _, err := m.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		s.parked.observe(obs, m.parkedRecords)
		return nil
	}, m.parkedRecords); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	opts := []grpc.ServerOption{
		// otelgrpc first: the access log's line, written at the call's
		// end, carries the span it opened.
		grpc.StatsHandler(otelgrpc.NewServerHandler(
			otelgrpc.WithMeterProvider(cfg.MeterProvider),
			otelgrpc.WithTracerProvider(cfg.TracerProvider),
			otelgrpc.WithFilter(filters.Not(filters.HealthCheck())))),
		grpc.StatsHandler(s.accessLog),
		grpc.ChainUnaryInterceptor(s.unaryInterceptors()...),
		grpc.ChainStreamInterceptor(s.streamInterceptors()...),
		// Room for the largest allowed result plus the rest of a request, and for
		// a batch a little over its bound, to be told INVALID_ARGUMENT.
		grpc.MaxRecvMsgSize(max(cfg.Limits.MaxResultBytes+64<<10, MaxBatchBytes+1<<20)),
		grpc.KeepaliveParams(cfg.Keepalive),
		grpc.KeepaliveEnforcementPolicy(keepaliveEnforcement),
		grpc.NumStreamWorkers(uint32(max(cfg.StreamWorkers, 0))),
		// Requests are decoded by the handlers, so that a malformed one is
		// INVALID_ARGUMENT and goes through the interceptors (codec.go).
		grpc.ForceServerCodecV2(newRequestCodec()),
	}
	opts = append(opts, cfg.Bounds.serverOptions(newPendingCalls(cfg.Bounds.MaxPendingCalls-cfg.Bounds.MaxPendingCalls/2, m))...)
	if cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cfg.TLS)))
	}
	g := grpc.NewServer(opts...)
	r := decodingRegistrar{g}
	idemregv1.RegisterRegistryServiceServer(r, svc)
	idemregv1.RegisterAdminServiceServer(r, newAdminService(svc, cfg.ResultTypes))
	h := health.NewServer()
	for _, name := range healthServices {
		h.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	h.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(r, h)
	if !cfg.DisableReflection {
		reflection.Register(r)
	}
	s.grpc, s.health = g, h
	return s, nil
}

// Waiting reports how many Claims wait for a key in progress now: decided
// once with the key in progress and asleep until it changes, so that a
// change made after Waiting counted a Claim is one it waits for.
func (s *Server) Waiting() int { return s.svc.waiters.Waiting() }

// GRPCServer returns the underlying server, to register more services.
func (s *Server) GRPCServer() *grpc.Server { return s.grpc }

// ErrStoreFailed is what Serve returns after the store failed for good
// (storage.Failing), wrapping the store's cause: the process should exit
// so that its supervisor starts a new one, which recovers the store from
// what it synced.
var ErrStoreFailed = errors.New("the store failed; exiting so that a new process recovers it")

// Serve serves on lis until ctx ends, then reports NOT_SERVING, drains
// in-flight calls for up to ShutdownTimeout and stops. When the store
// fails for good (storage.Failing) it does the same at once, calls
// answering UNAVAILABLE meanwhile, and returns ErrStoreFailed.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	defer close(s.done)
	ctx, cancel := context.WithCancel(ctx)
	var loops sync.WaitGroup
	defer func() { cancel(); loops.Wait() }() // no loop outlives Serve
	s.checkHealth(ctx)
	go s.watchHealth(ctx)
	loops.Go(func() { s.svc.quotas.Run(ctx, s.cfg.QuotaRefresh) })
	loops.Go(func() { s.parked.run(ctx, s.cfg.ParkedCountInterval) })

	lis = s.limitConnections("grpc", lis)
	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(lis) }()
	var failed <-chan struct{}
	fails, _ := s.store.(storage.Failing)
	if fails != nil {
		failed = fails.Failed()
	}
	var storeErr error
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	case <-failed:
		// Health first, before anything that can take time: callers
		// already get UNAVAILABLE from the store, and load balancers
		// and probes must stop sending here at once.
		s.health.Shutdown()
		storeErr = fmt.Errorf("%w: %w", ErrStoreFailed, fails.Failure())
		s.cfg.Logger.Error("store failed: not serving, stopping so that the process exits and its supervisor restarts it",
			"error", fails.Failure(), "drain_delay", s.cfg.DrainDelay)
	}
	s.health.Shutdown()   // every service NOT_SERVING, so load balancers drain us first
	s.svc.waiters.Drain() // waiting Claims answer now, as they are
	if s.cfg.DrainDelay > 0 {
		s.cfg.Logger.Info("not serving, waiting for load balancers", "drain_delay", s.cfg.DrainDelay)
		select {
		case <-time.After(s.cfg.DrainDelay):
		case err := <-served:
			return err
		}
	}
	s.cfg.Logger.Info("draining", "timeout", s.cfg.ShutdownTimeout)
	drained := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(s.cfg.ShutdownTimeout):
		s.cfg.Logger.Warn("drain timed out, closing connections")
		s.grpc.Stop()
	}
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return errors.Join(storeErr, err)
	}
	return storeErr
}

// ServeHealth serves the health service alone, in plaintext, on lis, until
// Serve returns: for Kubernetes' gRPC probes, which cannot speak TLS, and
// other probes that should not need credentials. It reports the same
// statuses as the health service of the main listener, under the same
// bounds (its connections are counted apart, its Watch streams with those
// of the main listener).
func (s *Server) ServeHealth(lis net.Listener) error {
	// The same codec as the main listener, so that a malformed check is
	// INVALID_ARGUMENT there too (codec.go).
	opts := append(s.cfg.Bounds.serverOptions(newPendingCalls(s.cfg.Bounds.MaxPendingCalls/2, s.metrics)),
		grpc.ForceServerCodecV2(newRequestCodec()),
		grpc.UnaryInterceptor(refuseMalformed),
		grpc.ChainStreamInterceptor(s.public.intercept),
		// A health request is a service name.
		grpc.MaxRecvMsgSize(healthMaxRecvMsgSize),
		grpc.KeepaliveParams(s.cfg.Keepalive),
		grpc.KeepaliveEnforcementPolicy(keepaliveEnforcement))
	g := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(decodingRegistrar{g}, s.health)
	lis = s.limitConnections("health", lis)
	go func() { <-s.done; g.Stop() }()
	if err := g.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// limitConnections bounds the connections of a listener and shows their
// number in the connections gauge.
func (s *Server) limitConnections(name string, lis net.Listener) net.Listener {
	l := limitConnections(lis, s.cfg.Bounds.MaxConnections)
	s.listeners.Store(name, l)
	return l
}

// healthMaxRecvMsgSize bounds a request on the health listener: a
// HealthCheckRequest is one service name.
const healthMaxRecvMsgSize = 4 << 10

func (s *Server) watchHealth(ctx context.Context) {
	t := time.NewTicker(s.cfg.HealthInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.checkHealth(ctx)
		}
	}
}

// checkHealth pings the store, reads the probe record and counts the
// interval's store calls (readiness.go), and sets the serving status
// accordingly.
func (s *Server) checkHealth(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, s.cfg.PingTimeout)
	err := s.store.Ping(pctx)
	cancel()
	if err == nil {
		pctx, cancel = context.WithTimeout(ctx, s.cfg.PingTimeout)
		_, err = s.store.Lookup(pctx, readinessProbeKey)
		cancel()
		if errors.Is(err, storage.ErrNotFound) {
			err = nil
		}
	}
	if ctx.Err() != nil {
		return
	}
	calls, failing := s.window.add(s.outcomes)
	st := healthpb.HealthCheckResponse_SERVING
	if err != nil || failing {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	if st == s.serving {
		return
	}
	s.serving = st
	switch {
	case err != nil:
		s.cfg.Logger.Warn("health changed", "status", st.String(), "error", err)
	case failing:
		s.cfg.Logger.Warn("health changed", "status", st.String(), "reason", "store calls failing",
			"failed_calls", calls.failed, "calls", calls.ok+calls.failed, "window_intervals", s.cfg.Readiness.Window)
	default:
		s.cfg.Logger.Info("health changed", "status", st.String())
	}
	for _, name := range healthServices {
		s.health.SetServingStatus(name, st)
	}
}

// The middleware chain, outermost first. Before it, otelgrpc's stats
// handler opens the call's span and measures it (every call, health checks
// left out of traces).
//  1. access log (accesslog.go): notes the consumer for the line per
//     finished call (method, code, duration, consumer, identity — never
//     payloads, results, fingerprints or tokens) that its stats handler
//     writes when gRPC has sent the status;
//  2. recovery: a panic, here or below, becomes INTERNAL and is logged
//     with its stack;
//  3. deadline: a request without a deadline gets RequestTimeout, a longer
//     one is clamped to MaxRequestTimeout;
//  4. authentication (go-grpc-middleware auth, skipped for health and
//     reflection by selector): the caller's identity from a bearer token
//     or a verified client certificate, or UNAUTHENTICATED;
//  5. a request that did not decode is refused (codec.go): INVALID_ARGUMENT,
//     reason MALFORMED_REQUEST;
//  6. authorization (same selector): the identity may use the request's
//     consumer (RegistryService) or administer it (AdminService; for a
//     request by consumer prefix, at least one consumer under it, and the
//     handler shows only those), or PERMISSION_DENIED — before the handler
//     has read anything;
//  7. calls per identity (bounds.go): an identity with MaxCallsPerIdentity
//     calls in progress gets RESOURCE_EXHAUSTED, TOO_MANY_CALLS;
//  8. rate limit: the identity's token bucket, then the consumer's, or
//     RESOURCE_EXHAUSTED with QuotaFailure and RetryInfo; each item of a
//     batch on its own (batch.go).
//
// Below the handlers of both services, the store is wrapped in one chain
// (server/internal/storechain): a record operation gets the request's
// deadline less a margin, is bounded in flight (UNAVAILABLE, OVERLOADED,
// beyond MaxInFlight, or beyond MaxInFlightPerIdentity for one identity) and
// measured, in one place.
func (s *Server) unaryInterceptors() []grpc.UnaryServerInterceptor {
	logger := s.cfg.Logger
	protected := selector.MatchFunc(func(ctx context.Context, c interceptors.CallMeta) bool { return !public(ctx, c) })
	return []grpc.UnaryServerInterceptor{
		s.accessLog.unary,
		recovery.UnaryServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
		s.deadline,
		selector.UnaryServerInterceptor(auth.UnaryServerInterceptor(s.authenticate), protected),
		refuseMalformed,
		selector.UnaryServerInterceptor(s.authorize, protected),
		selector.UnaryServerInterceptor(s.identityCalls.intercept, protected),
		s.rateLimit,
	}
}

// streamInterceptors: every streaming method is public (health's Watch,
// reflection); any other is refused, since authorization needs the
// request's consumer.
func (s *Server) streamInterceptors() []grpc.StreamServerInterceptor {
	logger := s.cfg.Logger
	protected := selector.MatchFunc(func(ctx context.Context, c interceptors.CallMeta) bool { return !public(ctx, c) })
	return []grpc.StreamServerInterceptor{
		recovery.StreamServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
		selector.StreamServerInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, _ grpc.StreamHandler) error {
			return reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED, "streaming methods are not open to identities", nil)
		}, protected),
		// What is left is public: bounded in number, since no credential
		// stands behind it.
		s.public.intercept,
	}
}

func panicHandler(logger *slog.Logger) recovery.RecoveryHandlerFuncContext {
	return func(ctx context.Context, p any) error {
		logger.ErrorContext(ctx, "panic recovered", "panic", p, "stack", string(debug.Stack()))
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
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
