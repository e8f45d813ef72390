package server

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc/codes"

	"github.com/idemreg/idemreg/server/internal/admission"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/replicas"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/server/internal/waiting"
)

// MeterName is the instrumentation scope of the registry's instruments.
const MeterName = "github.com/idemreg/idemreg/server"

// Instrument names, documented in docs/operations.md. The Prometheus
// exporter writes them with underscores and unit suffixes
// (idemreg_claims_total, idemreg_store_duration_seconds).
const (
	MetricClaims        = storechain.MetricClaims
	MetricCompletes     = storechain.MetricCompletes
	MetricReleases      = storechain.MetricReleases
	MetricExtends       = storechain.MetricExtends
	MetricParks         = storechain.MetricParks
	MetricLeaseLost     = storechain.MetricLeaseLost
	MetricStoreDuration = storechain.MetricStoreDuration
	MetricStoreErrors   = storechain.MetricStoreErrors
	MetricStoreInFlight = storechain.MetricStoreInFlight
	MetricOverloaded    = storechain.MetricOverloaded
	MetricRateLimited   = "idemreg.rate_limited"
	MetricDenied        = "idemreg.auth.denied"
	// MetricLogSampled counts the access log lines of refused calls that
	// sampling left out (accesslog.go), by code: the calls themselves are
	// all counted, by otelgrpc's rpc.server.call.duration and the
	// counters of each refusal.
	MetricLogSampled    = "idemreg.access_log.sampled_out"
	MetricAdminActions  = "idemreg.admin.actions"
	MetricBoundRefused  = admission.MetricBoundRefused
	MetricConnections   = admission.MetricConnections
	MetricBatchSize     = storechain.MetricBatchSize
	MetricWaits         = "idemreg.waits"
	MetricWaitDuration  = "idemreg.wait.duration"
	MetricWaitsRefused  = "idemreg.waits.refused"
	MetricParkedRecords = "idemreg.parked_records"
	// MetricQuotaRefreshes counts the counts of the quotas' usage, by
	// result (ok, failed: server/internal/quota).
	MetricQuotaRefreshes = quota.MetricRefreshes
	MetricPeerWakes      = replicas.MetricPeerWakes
	// MetricPeerWakesReceived counts the Wakes this replica was sent, by
	// result (server/internal/peers: woken, stale, replayed,
	// other_replica, unsealed).
	MetricPeerWakesReceived = replicas.MetricPeerWakesReceived
	// MetricRefusalsSlowed counts the refusals of callers over their
	// budget (refusals.go), by whose budget (by: identity, source) and
	// result (held, or full: answered at once, the held slots taken);
	// MetricRefusalsHeld is how many are held now.
	MetricRefusalsSlowed = "idemreg.refusals.slowed"
	MetricRefusalsHeld   = "idemreg.refusals.held"
)

// How a waiting Claim ended, the values of the "ended" attribute of
// idemreg.waits and idemreg.wait.duration.
const (
	WaitCompleted = waiting.Completed // the record was completed: the result is replayed
	WaitAcquired  = waiting.Acquired  // the lease ended or was released: the caller took over
	WaitParked    = waiting.Parked    // the record was parked: OUTCOME_PARKED
	WaitElapsed   = waiting.Elapsed   // wait passed with the key still in progress
	WaitCanceled  = waiting.Canceled  // the caller's context ended
	WaitFull      = waiting.Full      // the replica had MaxWaiters waiting: answered at once
	WaitDrained   = waiting.Drained   // the server was shutting down
	WaitError     = waiting.Error     // the store failed (or the fingerprint did not match)
)

// Claim outcomes, the values of the "outcome" attribute of idemreg.claims.
const (
	ClaimAcquired   = storechain.ClaimAcquired
	ClaimRepeat     = storechain.ClaimRepeat
	ClaimTakeover   = storechain.ClaimTakeover
	ClaimInProgress = storechain.ClaimInProgress
	ClaimReplay     = storechain.ClaimReplay
	ClaimMismatch   = storechain.ClaimMismatch
	ClaimParked     = storechain.ClaimParked
)

// metrics are the instruments of the request path; the store chain's
// (claims by outcome, store durations and errors, in flight, overload,
// batch sizes) are server/internal/storechain's, the bounds' (refusals,
// connections) server/internal/admission's, the peers' wakes
// server/internal/replicas', all in the same scope.
type metrics struct {
	rateLimited, denied, adminActions metric.Int64Counter
	waits, waitsRefused, logSampled   metric.Int64Counter
	refusalsSlowed                    metric.Int64Counter
	refusalsHeld                      metric.Int64UpDownCounter
	waitDuration                      metric.Float64Histogram
	parkedRecords                     metric.Int64ObservableGauge
	meter                             metric.Meter
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := mp.Meter(MeterName)
	var (
		out  = metrics{meter: m}
		errs []error
	)
	counter := func(dst *metric.Int64Counter, name, unit, desc string) {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		*dst = c
	}
	counter(&out.rateLimited, MetricRateLimited, "{call}", "Calls refused with RATE_LIMITED, by identity.")
	counter(&out.denied, MetricDenied, "{call}", "Calls refused with UNAUTHENTICATED or PERMISSION_DENIED, by code.")
	counter(&out.logSampled, MetricLogSampled, "{line}", "Access log lines of refused calls left out by sampling, by code.")
	counter(&out.adminActions, MetricAdminActions, "{call}", "AdminService calls, by action and result (ok or the error reason).")
	counter(&out.waits, MetricWaits, "{claim}", "Claims that waited for a key in progress, by how they ended (ended: completed, acquired, parked, elapsed, canceled, full, drained, error).")
	counter(&out.waitsRefused, MetricWaitsRefused, "{claim}", "Claims with a wait answered at once, key in progress, because the replica had --max-waiters waiting (bound=server) or the caller's identity had its share of them (bound=identity, with identity).")
	counter(&out.refusalsSlowed, MetricRefusalsSlowed, "{call}", "Refusals of callers over their budget (--refusal-rate), by whose budget (by: identity, source) and result: held (answered after --refusal-delay) or full (the held slots taken: answered at once).")
	var err error
	out.refusalsHeld, err = m.Int64UpDownCounter(MetricRefusalsHeld, metric.WithUnit("{call}"),
		metric.WithDescription("Refusals held now, to be answered after the refusal delay."))
	errs = append(errs, err)
	out.waitDuration, err = m.Float64Histogram(MetricWaitDuration, metric.WithUnit("s"),
		metric.WithDescription("How long Claims waited for a key in progress, by how they ended."),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
	errs = append(errs, err)
	out.parkedRecords, err = m.Int64ObservableGauge(MetricParkedRecords, metric.WithUnit("{record}"),
		metric.WithDescription("Live parked records per consumer, as the store counted them at the last count (every ParkedCountInterval); the same on every replica of one database."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	return &out, nil
}

// zero adds 0 to each counter's series that can be known before its first
// event, so that they are on /metrics from the start: an alert on rate()
// (or increase()) sees no series, and so never fires, for a counter that
// has not counted yet. Series of identities are those of ids, the
// identities of the config file at start (an identity added by a reload
// appears at its first event).
func (m *metrics) zero(ctx context.Context, ids []string) {
	for _, id := range ids {
		m.rateLimited.Add(ctx, 0, identityAttr(id))
	}
	for _, c := range []codes.Code{codes.Unauthenticated, codes.PermissionDenied} {
		m.denied.Add(ctx, 0, codeAttr(c))
	}
	for _, e := range []string{WaitCompleted, WaitAcquired, WaitParked, WaitElapsed, WaitCanceled, WaitFull, WaitDrained, WaitError} {
		m.waits.Add(ctx, 0, attrs(attribute.String("ended", e)))
	}
	m.waitsRefused.Add(ctx, 0, attrs(attribute.String("bound", waiting.BoundServer)))
}

func attrs(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(kv...))
}

// codeAttrs are the measurement options {code: <code>} of every code,
// built once: attribute.NewSet sorts and allocates, and on a refused call,
// which does little else, building them took a tenth of the server's CPU.
var codeAttrs = func() (out [17]metric.MeasurementOption) {
	for c := range out {
		out[c] = attrs(attribute.String("code", codeName(codes.Code(c))))
	}
	return out
}()

// codeAttr returns the measurement option {code: c}.
func codeAttr(c codes.Code) metric.MeasurementOption {
	if int(c) < len(codeAttrs) {
		return codeAttrs[c]
	}
	return attrs(attribute.String("code", codeName(c)))
}

// identityAttrs caches the measurement options {identity: <name>}, for the
// same reason. Names come from the config file, never from a request, so
// the cache is bounded by the identities the files named.
var identityAttrs sync.Map // string → metric.MeasurementOption

func identityAttr(name string) metric.MeasurementOption {
	if o, ok := identityAttrs.Load(name); ok {
		return o.(metric.MeasurementOption)
	}
	o, _ := identityAttrs.LoadOrStore(name, attrs(attribute.String("identity", name)))
	return o.(metric.MeasurementOption)
}
