package server

import (
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc/codes"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/waiting"
)

// MeterName is the instrumentation scope of the registry's instruments.
const MeterName = "github.com/idemreg/idemreg/server"

// Instrument names, documented in docs/operations.md. The Prometheus
// exporter writes them with underscores and unit suffixes
// (idemreg_claims_total, idemreg_store_duration_seconds).
const (
	MetricClaims        = "idemreg.claims"
	MetricCompletes     = "idemreg.completes"
	MetricReleases      = "idemreg.releases"
	MetricExtends       = "idemreg.extends"
	MetricParks         = "idemreg.parks"
	MetricLeaseLost     = "idemreg.lease_lost"
	MetricStoreDuration = "idemreg.store.duration"
	MetricStoreErrors   = "idemreg.store.errors"
	MetricStoreInFlight = "idemreg.store.in_flight"
	MetricOverloaded    = "idemreg.overloaded"
	MetricRateLimited   = "idemreg.rate_limited"
	MetricDenied        = "idemreg.auth.denied"
	// MetricLogSampled counts the access log lines of refused calls that
	// sampling left out (accesslog.go), by code: the calls themselves are
	// all counted, by otelgrpc's rpc.server.call.duration and the
	// counters of each refusal.
	MetricLogSampled    = "idemreg.access_log.sampled_out"
	MetricAdminActions  = "idemreg.admin.actions"
	MetricBoundRefused  = "idemreg.bounds.refused"
	MetricConnections   = "idemreg.connections"
	MetricBatchSize     = "idemreg.batch.size"
	MetricWaits         = "idemreg.waits"
	MetricWaitDuration  = "idemreg.wait.duration"
	MetricWaitsRefused  = "idemreg.waits.refused"
	MetricParkedRecords = "idemreg.parked_records"
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
	ClaimAcquired   = "acquired"    // a new key, or one whose record had expired: attempt 1
	ClaimRepeat     = "repeat"      // a repeat of the Claim that holds the lease (same request_id)
	ClaimTakeover   = "takeover"    // a key released, invalidated or whose lease ran out: attempt > 1
	ClaimInProgress = "in_progress" // another holder's lease is live
	ClaimReplay     = "replay"      // completed: the stored result is replayed
	ClaimMismatch   = "mismatch"    // FINGERPRINT_MISMATCH
	ClaimParked     = "parked"      // the record is parked (or this Claim parked it at max_attempts)
)

type metrics struct {
	claims, completes, releases, extends, parks  metric.Int64Counter
	leaseLost                                    metric.Int64Counter
	storeErrors, overloaded, rateLimited, denied metric.Int64Counter
	adminActions, boundRefused, waits            metric.Int64Counter
	logSampled                                   metric.Int64Counter
	waitsRefused                                 metric.Int64Counter
	storeDuration, waitDuration                  metric.Float64Histogram
	batchSize                                    metric.Int64Histogram
	inFlight, connections                        metric.Int64ObservableUpDownCounter
	parkedRecords                                metric.Int64ObservableGauge
	meter                                        metric.Meter
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
	counter(&out.claims, MetricClaims, "{claim}", "Claims answered, by outcome: acquired, takeover, repeat, in_progress, replay, mismatch, parked.")
	counter(&out.completes, MetricCompletes, "{call}", "Successful Completes (a repeat with the same token counts again).")
	counter(&out.releases, MetricReleases, "{call}", "Successful Releases.")
	counter(&out.extends, MetricExtends, "{call}", "Successful Extends.")
	counter(&out.parks, MetricParks, "{call}", "Successful Parks (a repeat with the same token counts again).")
	counter(&out.leaseLost, MetricLeaseLost, "{call}", "Completes, Releases and Extends refused with LEASE_LOST (a stale token), by method.")
	counter(&out.storeErrors, MetricStoreErrors, "{error}", "Failed store calls, by op and error.type: unavailable, deadline, canceled, internal.")
	counter(&out.overloaded, MetricOverloaded, "{call}", "Calls refused with OVERLOADED because the store already had the most operations in flight (bound=server) or the caller's identity had its share of them (bound=identity).")
	counter(&out.rateLimited, MetricRateLimited, "{call}", "Calls refused with RATE_LIMITED, by identity.")
	counter(&out.denied, MetricDenied, "{call}", "Calls refused with UNAUTHENTICATED or PERMISSION_DENIED, by code.")
	counter(&out.logSampled, MetricLogSampled, "{line}", "Access log lines of refused calls left out by sampling, by code.")
	counter(&out.adminActions, MetricAdminActions, "{call}", "AdminService calls, by action and result (ok or the error reason).")
	counter(&out.waits, MetricWaits, "{claim}", "Claims that waited for a key in progress, by how they ended (ended: completed, acquired, parked, elapsed, canceled, full, drained, error).")
	counter(&out.waitsRefused, MetricWaitsRefused, "{claim}", "Claims with a wait answered at once, key in progress, because the replica had --max-waiters waiting (bound=server) or the caller's identity had its share of them (bound=identity, with identity).")
	counter(&out.boundRefused, MetricBoundRefused, "{call}", "Calls refused by a bound of server.Bounds, by bound: public_streams or pending_calls (TOO_MANY_STREAMS), or identity_calls (TOO_MANY_CALLS).")
	var err error
	out.waitDuration, err = m.Float64Histogram(MetricWaitDuration, metric.WithUnit("s"),
		metric.WithDescription("How long Claims waited for a key in progress, by how they ended."),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
	errs = append(errs, err)
	out.batchSize, err = m.Int64Histogram(MetricBatchSize, metric.WithUnit("{item}"),
		metric.WithDescription("Items of BatchClaim and BatchComplete calls that reached the store, by method."),
		metric.WithExplicitBucketBoundaries(1, 2, 5, 10, 25, 50, 100, 250, 500))
	errs = append(errs, err)
	out.storeDuration, err = m.Float64Histogram(MetricStoreDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of store calls (retries included), by op and outcome: ok, or the error type."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
	errs = append(errs, err)
	out.inFlight, err = m.Int64ObservableUpDownCounter(MetricStoreInFlight, metric.WithUnit("{call}"),
		metric.WithDescription("Store operations in flight."))
	errs = append(errs, err)
	out.connections, err = m.Int64ObservableUpDownCounter(MetricConnections, metric.WithUnit("{connection}"),
		metric.WithDescription("Connections open, by listener (grpc, health); each is bounded by MaxConnections."))
	errs = append(errs, err)
	out.parkedRecords, err = m.Int64ObservableGauge(MetricParkedRecords, metric.WithUnit("{record}"),
		metric.WithDescription("Live parked records per consumer, as the store counted them at the last count (every ParkedCountInterval); the same on every replica of one database."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	return &out, nil
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

// storeErrorType is the error.type of a store call that failed with
// reason (reason.Classify): the value of idemreg.store.errors' error.type and of
// idemreg.store.duration's outcome. Only failures have one: the registry's
// answers (isAnswer) are not failures of the store.
func storeErrorType(reason idemregv1.ErrorReason) string {
	switch reason {
	case idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED:
		return "deadline"
	case idemregv1.ErrorReason_ERROR_REASON_CANCELED:
		return "canceled"
	case idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE:
		return "unavailable"
	case idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED:
		return "exhausted"
	default:
		return "internal"
	}
}
