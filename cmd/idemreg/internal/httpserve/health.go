package httpserve

import (
	"context"
	"net/http"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// HealthChecks answers GET /healthz and /readyz for the probes and load
// balancers that speak HTTP but not gRPC health, by asking the server's
// own gRPC health service, so that the two can never disagree: /readyz
// is the server's readiness (health service "", or the service named by
// ?service=), /healthz its liveness (Liveness), which stays SERVING while
// the process runs whatever the store does.
//
// SERVING is a 200; NOT_SERVING (or any other status) a 503, as is a
// check that fails or takes longer than Timeout; a service the health
// service does not know a 404. The body is the status's name.
type HealthChecks struct {
	// Client asks the health service; serve passes a connection of
	// server.(*Server).InProcess, which reaches the health service with
	// no listener of its own and no credentials.
	Client healthpb.HealthClient
	// Liveness is the health service name /healthz checks
	// (server.LivenessService).
	Liveness string
	// Timeout bounds each check (DefaultHealthTimeout when zero).
	Timeout time.Duration
}

// DefaultHealthTimeout is a probe's usual patience (the kubelet's default
// timeoutSeconds is 1): a check slower than this is a failed probe
// anyway.
const DefaultHealthTimeout = time.Second

// Register adds GET /healthz and /readyz (and HEAD) to mux.
func (h HealthChecks) Register(mux *http.ServeMux) {
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { h.answer(w, r, h.Liveness) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) { h.answer(w, r, r.URL.Query().Get("service")) })
}

func (h HealthChecks) answer(w http.ResponseWriter, r *http.Request, service string) {
	timeout := h.Timeout
	if timeout <= 0 {
		timeout = DefaultHealthTimeout
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	res, err := h.Client.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	switch {
	case status.Code(err) == codes.NotFound:
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte("SERVICE_UNKNOWN\n"))
	case err != nil:
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte("UNKNOWN: " + status.Code(err).String() + "\n"))
	case res.GetStatus() == healthpb.HealthCheckResponse_SERVING:
		_, _ = w.Write([]byte("SERVING\n"))
	default:
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(res.GetStatus().String() + "\n"))
	}
}
