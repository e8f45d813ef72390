package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	reflectionv1grpc "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alphagrpc "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/internal/admission"
	"github.com/idemreg/idemreg/server/internal/replicas"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

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
	// done is closed when Serve returns; ServeHealth stops then.
	done chan struct{}
	// serving is the last status set; only Serve's health loop touches it.
	serving healthpb.HealthCheckResponse_ServingStatus
	// admission bounds connections, held calls, public streams and each
	// identity's calls, and refuses Claims near the memory limit
	// (server/internal/admission).
	admission *admission.Admission
	// refusals holds the refusals of callers over their budget; nil
	// holds none.
	refusals *refusalLimiter
	// parked is the last count of parked records, for the gauge.
	parked *parkedCounts
	// outcomes counts the service's store calls for readiness; window
	// (health loop only) keeps the last intervals' counts.
	outcomes *callOutcomes
	window   *readinessWindow
	// replicas is this replica among those sharing the store, and its
	// share of their limits (server/internal/replicas).
	replicas *replicas.Replicas
}

// New builds a Server on store.
func New(store storage.Store, cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	cfg.setDefaults()
	if cfg.File == nil {
		static := &configfile.Config{Access: cfg.Access, Policy: cfg.Policy}
		if static.Access == nil {
			static.Access = access.Open()
		}
		if static.Policy == nil {
			set, err := policy.NewSet(cfg.Limits.Policy())
			if err != nil {
				return nil, fmt.Errorf("server: %w", err)
			}
			static.Policy = set
		}
		cfg.File = configfile.Static(static)
	}
	m, err := newMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	b := cfg.Bounds
	adm, err := admission.New(admission.Config{
		MaxHeaderListSize: b.MaxHeaderListSize, MaxConcurrentStreams: b.MaxConcurrentStreams, ConnectionTimeout: b.ConnectionTimeout,
		MaxConnections: b.MaxConnections, MaxHealthConnectionsPerSource: b.MaxHealthConnectionsPerSource,
		MaxPublicStreams: b.MaxPublicStreams, MaxCallsPerIdentity: b.MaxCallsPerIdentity, MaxPendingCalls: b.MaxPendingCalls,
		Tenant: tenant, Meter: m.meter, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	outcomes := &callOutcomes{}
	chain, err := storechain.New(store, storechain.Config{MaxInFlight: cfg.MaxInFlight, PerIdentity: cfg.MaxInFlightPerIdentity,
		Meter: m.meter, Identity: tenant, Outcome: outcomes.record, Tracer: cfg.TracerProvider.Tracer(MeterName)})
	if err != nil {
		return nil, err
	}
	svc, err := newService(chain, cfg.Limits, func() *policy.Set { return cfg.File.Current().Policy }, cfg.Logger, m, serviceBounds{
		maxWaiters: cfg.MaxWaiters, maxWaitersPerIdentity: cfg.MaxWaitersPerIdentity, recheck: cfg.WaitRecheck,
		maxQuotaConsumersPerIdentity: cfg.MaxQuotaConsumersPerIdentity,
		claimKeyRefresh:              cfg.ClaimKeyRefresh, now: cfg.Now, admission: adm,
	})
	if err != nil {
		return nil, err
	}
	reps, err := replicas.New(replicas.Config{ID: cfg.Replica.ID, AdvertiseAddress: cfg.Replica.AdvertiseAddress,
		Heartbeat: cfg.Replica.HeartbeatInterval, LiveFor: cfg.Replica.MemberLiveFor,
		Store: store, Keys: svc.claimKeys(), TLS: cfg.TLS, Meter: m.meter, Logger: cfg.Logger})
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	// The config file's rate limits and quotas are the replicas': each
	// takes its share from the live members (docs/operations.md, "Limits
	// across replicas"), and tells them of the keys their Claims wait on.
	svc.shareWith(reps)
	s := &Server{
		cfg: cfg, store: store, svc: svc, metrics: m, limiter: access.NewLimiter(nil), done: make(chan struct{}),
		accessLog: accessLogger{logger: cfg.Logger, m: m},
		admission: adm,
		replicas:  reps,
		refusals:  newRefusalLimiter(cfg.RefusalRate, cfg.RefusalDelay, m),
		outcomes:  outcomes,
		window:    newReadinessWindow(cfg.Readiness),
		// The backend counts: the gauge's count is not a request's store call.
		parked: newParkedCounts(store, cfg.Logger),
	}
	if cfg.RefusalLogRate > 0 {
		s.accessLog.refusals = newRefusalSampler(cfg.RefusalLogRate)
	}
	ids := []string{access.Anonymous.Name}
	if set := cfg.File.Current().Access; set.Enforced() {
		ids = set.Identities()
	}
	m.zero(context.Background(), ids)
	if _, err := m.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		s.parked.observe(obs, m.parkedRecords)
		return nil
	}, m.parkedRecords); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	// The unary methods are carried as client streams (codec.go,
	// decodingRegistrar) and run this chain themselves.
	carried := newCarriedUnary(chainUnary(s.unaryInterceptors()...))
	opts := []grpc.ServerOption{
		// otelgrpc first: the access log's line, written at the call's
		// end, carries the span it opened.
		grpc.StatsHandler(otelgrpc.NewServerHandler(
			otelgrpc.WithMeterProvider(cfg.MeterProvider),
			otelgrpc.WithTracerProvider(cfg.TracerProvider),
			otelgrpc.WithFilter(filters.Not(filters.HealthCheck())))),
		grpc.StatsHandler(s.accessLog),
		grpc.UnaryInterceptor(carried.unary),
		grpc.StreamInterceptor(carried.streams(chainStream(s.streamInterceptors()...))),
		grpc.MaxRecvMsgSize(maxRequestBytes(cfg.Limits)),
		grpc.KeepaliveParams(cfg.Keepalive),
		grpc.KeepaliveEnforcementPolicy(keepaliveEnforcement),
		grpc.NumStreamWorkers(uint32(max(cfg.StreamWorkers, 0))),
		// Requests are decoded by the handlers, so that a malformed one is
		// INVALID_ARGUMENT and goes through the interceptors (codec.go).
		grpc.ForceServerCodecV2(newRequestCodec()),
	}
	if cfg.StaticWindow > 0 {
		opts = append(opts, grpc.StaticStreamWindowSize(int32(cfg.StaticWindow)), grpc.StaticConnWindowSize(int32(cfg.StaticWindow)))
	}
	opts = append(opts, adm.ServerOptions(admission.ListenerGRPC)...)
	creds := insecure.NewCredentials()
	if cfg.TLS != nil {
		creds = credentials.NewTLS(cfg.TLS)
	}
	opts = append(opts, grpc.Creds(inProcessCreds{creds})) // InProcess
	g := grpc.NewServer(opts...)
	r := decodingRegistrar{Server: g, carried: carried}
	idemregv1.RegisterRegistryServiceServer(r, svc)
	idemregv1.RegisterAdminServiceServer(r, withBackups(newAdminService(svc, cfg.ResultTypes), store))
	h := health.NewServer()
	for _, name := range healthServices {
		h.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	h.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(r, h)
	reps.Register(r, svc.wake)
	if !cfg.DisableReflection {
		registerReflection(r)
	}
	s.grpc, s.health = g, h
	return s, nil
}

// registerReflection registers reflection (v1, and v1alpha, which older
// tools still ask) over every service but the replicas' internal ones
// (idemreg.internal.*): they have no descriptor to send, so listing them
// made `buf curl --list-methods` fail as a whole, and grpcurl's describe
// of them fail (TestReflectionDescribesEveryService). They are still
// served; they are no API.
func registerReflection(r decodingRegistrar) {
	opts := reflection.ServerOptions{Services: describedServices{r.Server}}
	reflectionv1grpc.RegisterServerReflectionServer(r, reflection.NewServerV1(opts))
	reflectionv1alphagrpc.RegisterServerReflectionServer(r, reflection.NewServer(opts))
}

// describedServices is a server's services less the internal ones.
type describedServices struct{ *grpc.Server }

func (s describedServices) GetServiceInfo() map[string]grpc.ServiceInfo {
	all := s.Server.GetServiceInfo()
	for name := range all {
		if strings.HasPrefix(name, "idemreg.internal.") {
			delete(all, name)
		}
	}
	return all
}

// Waiting reports how many Claims wait for a key in progress now: decided
// once with the key in progress and asleep until it changes, so that a
// change made after Waiting counted a Claim is one it waits for.
func (s *Server) Waiting() int { return s.svc.waiting() }

// Members returns the replicas sharing the store as this one last read
// them (this one among them once it has heartbeat), nil before Serve or
// when the store keeps no membership.
func (s *Server) Members() []storage.Member { return s.replicas.Members() }

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
	loops.Go(func() { s.svc.run(ctx, s.cfg.QuotaRefresh) })
	loops.Go(func() { s.parked.run(ctx, s.cfg.ParkedCountInterval) })
	loops.Go(func() { s.admission.Run(ctx) })
	if beat := s.replicas.Join(ctx, lis.Addr()); beat != nil {
		loops.Go(beat)
	}

	lis = s.admission.Listen(admission.ListenerGRPC, lis)
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
	s.health.Shutdown() // every service NOT_SERVING, so load balancers drain us first
	s.svc.drain()       // waiting Claims answer now, as they are
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
