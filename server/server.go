package server

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"runtime/debug"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/policy"
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
	// HealthInterval is how often the store is pinged to drive the health
	// service (default 2s); PingTimeout bounds each ping (default 1s).
	HealthInterval, PingTimeout time.Duration
	// ShutdownTimeout bounds the graceful drain before connections are cut
	// (default 10s).
	ShutdownTimeout time.Duration
	// DisableReflection turns server reflection off (it is on by default so
	// grpcurl works out of the box).
	DisableReflection bool
}

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
}

// Server is the gRPC server of the registry: the RegistryService, health
// (SERVING only while the store answers) and reflection.
type Server struct {
	cfg    Config
	store  storage.Store
	grpc   *grpc.Server
	health *health.Server
	// serving is the last status set; only Serve's health loop touches it.
	serving healthpb.HealthCheckResponse_ServingStatus
}

// healthServices are the names the health service reports on: the whole
// server ("") and the registry service.
var healthServices = []string{"", idemregv1.RegistryService_ServiceDesc.ServiceName}

// New builds a Server on store.
func New(store storage.Store, cfg Config) (*Server, error) {
	cfg.setDefaults()
	svc, err := NewService(store, cfg.Limits, cfg.Logger)
	if err != nil {
		return nil, err
	}
	if cfg.Policy != nil {
		svc.policies = cfg.Policy
	}
	g := grpc.NewServer(
		grpc.ChainUnaryInterceptor(unaryInterceptors(cfg.Logger)...),
		grpc.ChainStreamInterceptor(streamInterceptors(cfg.Logger)...),
		// Room for the largest allowed result plus the rest of a request.
		grpc.MaxRecvMsgSize(cfg.Limits.MaxResultBytes+64<<10),
	)
	idemregv1.RegisterRegistryServiceServer(g, svc)
	h := health.NewServer()
	for _, name := range healthServices {
		h.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	healthpb.RegisterHealthServer(g, h)
	if !cfg.DisableReflection {
		reflection.Register(g)
	}
	return &Server{cfg: cfg, store: store, grpc: g, health: h}, nil
}

// GRPCServer returns the underlying server, to register more services.
func (s *Server) GRPCServer() *grpc.Server { return s.grpc }

// Serve serves on lis until ctx ends, then reports NOT_SERVING, drains
// in-flight calls for up to ShutdownTimeout and stops.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.checkHealth(ctx)
	go s.watchHealth(ctx)

	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(lis) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	s.health.Shutdown() // every service NOT_SERVING, so load balancers drain us first
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
		return err
	}
	return nil
}

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

// checkHealth pings the store and sets the serving status accordingly.
func (s *Server) checkHealth(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, s.cfg.PingTimeout)
	err := s.store.Ping(pctx)
	cancel()
	if ctx.Err() != nil {
		return
	}
	st := healthpb.HealthCheckResponse_SERVING
	if err != nil {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	if st == s.serving {
		return
	}
	s.serving = st
	if err != nil {
		s.cfg.Logger.Warn("health changed", "status", st.String(), "error", err)
	} else {
		s.cfg.Logger.Info("health changed", "status", st.String())
	}
	for _, name := range healthServices {
		s.health.SetServingStatus(name, st)
	}
}

// The middleware chain, outermost first:
//  1. consumer fields: puts the request's consumer into the log fields;
//  2. logging: one structured line per finished call (method, code,
//     duration, consumer) — never payloads, results, fingerprints or tokens;
//  3. recovery: a panic becomes INTERNAL and is logged with its stack.
func unaryInterceptors(logger *slog.Logger) []grpc.UnaryServerInterceptor {
	return []grpc.UnaryServerInterceptor{
		consumerFields,
		logging.UnaryServerInterceptor(interceptorLogger(logger), loggingOptions...),
		recovery.UnaryServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
	}
}

func streamInterceptors(logger *slog.Logger) []grpc.StreamServerInterceptor {
	return []grpc.StreamServerInterceptor{
		logging.StreamServerInterceptor(interceptorLogger(logger), loggingOptions...),
		recovery.StreamServerInterceptor(recovery.WithRecoveryHandlerContext(panicHandler(logger))),
	}
}

var loggingOptions = []logging.Option{logging.WithLogOnEvents(logging.FinishCall)}

func interceptorLogger(l *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}

func consumerFields(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	if r, ok := req.(interface{ GetConsumer() string }); ok {
		ctx = logging.InjectFields(ctx, logging.Fields{"consumer", r.GetConsumer()})
	}
	return next(ctx, req)
}

func panicHandler(logger *slog.Logger) recovery.RecoveryHandlerFuncContext {
	return func(ctx context.Context, p any) error {
		logger.ErrorContext(ctx, "panic recovered", "panic", p, "stack", string(debug.Stack()))
		return newStatus(codes.Internal, ReasonInternal, "internal error", nil)
	}
}
