package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/admission"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/storage"
)

// healthServices are the names the health service reports readiness on:
// the whole server ("") and the registry's services.
var healthServices = []string{"", idemregv1.RegistryService_ServiceDesc.ServiceName, idemregv1.AdminService_ServiceDesc.ServiceName}

// LivenessService is the health service name that reports SERVING while the
// process runs, whatever the store does: a liveness probe that failed with
// the database would restart every replica at once and fix nothing.
const LivenessService = "liveness"

// ServeHealth serves the health service alone, in plaintext, on lis, until
// Serve returns: for Kubernetes' gRPC probes, which cannot speak TLS, and
// other probes that should not need credentials. It reports the same
// statuses as the health service of the main listener, under the same
// bounds (its connections are counted apart, its Watch streams with those
// of the main listener), and one source address holds at most
// MaxHealthConnectionsPerSource of its connections, so that a flood from
// one source leaves the kubelet's probes a slot.
func (s *Server) ServeHealth(lis net.Listener) error {
	// The same codec as the main listener, so that a malformed check is
	// INVALID_ARGUMENT there too (codec.go).
	carried := newCarriedUnary(refuseMalformed)
	opts := append(s.admission.ServerOptions(admission.ListenerHealth),
		grpc.ForceServerCodecV2(newRequestCodec()),
		grpc.UnaryInterceptor(carried.unary),
		grpc.StreamInterceptor(carried.streams(s.admission.PublicStream)),
		// A health request is a service name.
		grpc.MaxRecvMsgSize(healthMaxRecvMsgSize),
		// After ServerOptions' MaxConcurrentStreams, which it replaces.
		grpc.MaxConcurrentStreams(HealthMaxConcurrentStreams),
		grpc.KeepaliveParams(s.cfg.Keepalive),
		grpc.KeepaliveEnforcementPolicy(keepaliveEnforcement))
	g := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(decodingRegistrar{Server: g, carried: carried}, s.health)
	lis = s.admission.Listen(admission.ListenerHealth, lis)
	go func() { <-s.done; g.Stop() }()
	if err := g.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// HealthMaxConcurrentStreams bounds the calls of one connection to the
// health listener. A probe opens a connection for a check or two (the
// kubelet one per probe); with the main listener's 64, one source's
// MaxHealthConnectionsPerSource connections held the listener's whole
// share of pending calls (16 × 64 = 1,024), and the probes were refused
// TOO_MANY_STREAMS. With 4, all of MaxConnections (128 × 4 = 512) cannot
// take that share: only connection slots can keep a probe out, and a
// source holds at most its share of those.
const HealthMaxConcurrentStreams = 4

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
// interval's store calls (below), and sets the serving status
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

// Readiness decides when the health service reports NOT_SERVING besides a
// failed ping: a store can answer `SELECT 1` while every real query fails
// (a table gone or locked, a database turned read-only, a disk full that
// refuses writes). Each health interval the server also reads a record
// (the probe: it fails when reads fail) and counts the outcomes of the
// calls the service made to the store since the last interval; the server
// is unready while the probe fails, or while at least MaxFailureRatio of
// the calls in the last Window intervals failed, if they were at least
// MinCalls.
//
// Only the store's own failures count against it (storage.ErrUnavailable:
// a broken connection, a statement refused): the registry's answers
// (fenced, mismatch, not found) count as successes, and what a caller
// decides (a cancelled call, its deadline, which it can make as short as it
// likes) and calls refused before the store (overload) do not count. Nor
// do refusals for a short resource (CAPACITY_EXHAUSTED: a disk below its
// reserve): the store still serves reads and the Completes of held keys,
// which an unready replica would no longer be sent. A store that failed
// for good (storage.Failing) turns the server NOT_SERVING at once
// (Server.Serve), without waiting for a window.
//
// An unready replica gets few new calls, so its window empties and the
// probe and ping alone decide again: where only writes fail, it turns
// ready, takes calls, and turns unready again after MinCalls of them, at
// most once a Window.
type Readiness struct {
	// Window is how many health intervals the failure rate is counted
	// over (DefaultReadinessWindow).
	Window int
	// MinCalls is the fewest store calls in the window that make a rate
	// (DefaultReadinessMinCalls); fewer say nothing.
	MinCalls int
	// MaxFailureRatio is the share of failed store calls in the window at
	// which the server is unready, in (0, 1] (DefaultReadinessMaxFailureRatio).
	MaxFailureRatio float64
}

const (
	// DefaultReadinessWindow: 10 s at the default health interval, longer
	// than a connection's reconnect and shorter than a probe's patience.
	DefaultReadinessWindow = 5
	// DefaultReadinessMinCalls: a handful of unlucky calls at low traffic
	// does not turn a replica away.
	DefaultReadinessMinCalls = 20
	// DefaultReadinessMaxFailureRatio: a store failing half the calls
	// serves a caller worse than another replica would.
	DefaultReadinessMaxFailureRatio = 0.5
)

// readinessProbeKey is the record the probe reads, under a consumer of the
// registry's own: whether it exists does not matter, only that the read
// answers.
var readinessProbeKey = storage.Key{Consumer: "idemreg.readiness-probe", Kind: storage.KindMessage, Key: "probe"}

func (r *Readiness) setDefaults() {
	if r.Window == 0 {
		r.Window = DefaultReadinessWindow
	}
	if r.MinCalls == 0 {
		r.MinCalls = DefaultReadinessMinCalls
	}
	if r.MaxFailureRatio == 0 {
		r.MaxFailureRatio = DefaultReadinessMaxFailureRatio
	}
}

// Validate reports settings that cannot work; zero fields take the
// defaults.
func (r Readiness) Validate() error {
	var errs []error
	if r.Window < 0 {
		errs = append(errs, fmt.Errorf("the readiness window must be positive, got %d intervals", r.Window))
	}
	if r.MinCalls < 0 {
		errs = append(errs, fmt.Errorf("the readiness minimum of calls must be positive, got %d", r.MinCalls))
	}
	if r.MaxFailureRatio < 0 || r.MaxFailureRatio > 1 {
		errs = append(errs, fmt.Errorf("the readiness failure ratio must be in (0, 1], got %v", r.MaxFailureRatio))
	}
	return errors.Join(errs...)
}

// callOutcomes counts the store calls of the service between two health
// checks; the calls pay two atomic adds.
type callOutcomes struct{ ok, failed atomic.Int64 }

// record counts one store call's outcome, if it says anything about the
// store (reason.Classify): STORE_UNAVAILABLE is the store failing; the caller's
// context ending (DEADLINE_EXCEEDED, CANCELED) and the server refusing the
// call (OVERLOADED) say nothing about it.
func (c *callOutcomes) record(err error) {
	if err == nil {
		c.ok.Add(1)
		return
	}
	switch r := reason.Classify(err); {
	case reason.IsAnswer(r):
		c.ok.Add(1)
	case r == idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE:
		c.failed.Add(1)
	}
}

type outcomeCount struct{ ok, failed int64 }

// readinessWindow is the counts of the last Window health intervals; only
// the health loop touches it.
type readinessWindow struct {
	cfg     Readiness
	buckets []outcomeCount
	next    int
}

func newReadinessWindow(cfg Readiness) *readinessWindow {
	return &readinessWindow{cfg: cfg, buckets: make([]outcomeCount, cfg.Window)}
}

// add closes an interval with the calls counted since the last one, and
// returns the totals of the window and whether they make the server
// unready.
func (w *readinessWindow) add(c *callOutcomes) (total outcomeCount, failing bool) {
	w.buckets[w.next] = outcomeCount{ok: c.ok.Swap(0), failed: c.failed.Swap(0)}
	w.next = (w.next + 1) % len(w.buckets)
	for _, b := range w.buckets {
		total.ok += b.ok
		total.failed += b.failed
	}
	calls := total.ok + total.failed
	return total, calls >= int64(w.cfg.MinCalls) && float64(total.failed) >= w.cfg.MaxFailureRatio*float64(calls)
}
