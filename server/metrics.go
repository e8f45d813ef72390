package server

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemreg/idemreg/storage"
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
	MetricLeaseLost     = "idemreg.lease_lost"
	MetricStoreDuration = "idemreg.store.duration"
	MetricStoreErrors   = "idemreg.store.errors"
	MetricStoreInFlight = "idemreg.store.in_flight"
	MetricOverloaded    = "idemreg.overloaded"
	MetricRateLimited   = "idemreg.rate_limited"
	MetricDenied        = "idemreg.auth.denied"
	MetricAdminActions  = "idemreg.admin.actions"
)

// Claim outcomes, the values of the "outcome" attribute of idemreg.claims.
const (
	ClaimAcquired   = "acquired"    // a new key, or one whose record had expired: attempt 1
	ClaimRepeat     = "repeat"      // a repeat of the Claim that holds the lease (same request_id)
	ClaimTakeover   = "takeover"    // a key released, invalidated or whose lease ran out: attempt > 1
	ClaimInProgress = "in_progress" // another holder's lease is live
	ClaimReplay     = "replay"      // completed: the stored result is replayed
	ClaimMismatch   = "mismatch"    // FINGERPRINT_MISMATCH
)

type metrics struct {
	claims, completes, releases, extends, leaseLost metric.Int64Counter
	storeErrors, overloaded, rateLimited, denied    metric.Int64Counter
	adminActions                                    metric.Int64Counter
	storeDuration                                   metric.Float64Histogram
	inFlight                                        metric.Int64ObservableUpDownCounter
	meter                                           metric.Meter
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
	counter(&out.claims, MetricClaims, "{claim}", "Claims answered, by outcome: acquired, takeover, repeat, in_progress, replay, mismatch.")
	counter(&out.completes, MetricCompletes, "{call}", "Successful Completes (a repeat with the same token counts again).")
	counter(&out.releases, MetricReleases, "{call}", "Successful Releases.")
	counter(&out.extends, MetricExtends, "{call}", "Successful Extends.")
	counter(&out.leaseLost, MetricLeaseLost, "{call}", "Completes, Releases and Extends refused with LEASE_LOST (a stale token), by method.")
	counter(&out.storeErrors, MetricStoreErrors, "{error}", "Failed store calls, by op and error.type: unavailable, deadline, canceled, internal.")
	counter(&out.overloaded, MetricOverloaded, "{call}", "Calls refused with OVERLOADED because the store already had the most operations in flight (bound=server) or the caller's identity had its share of them (bound=identity).")
	counter(&out.rateLimited, MetricRateLimited, "{call}", "Calls refused with RATE_LIMITED, by identity.")
	counter(&out.denied, MetricDenied, "{call}", "Calls refused with UNAUTHENTICATED or PERMISSION_DENIED, by code.")
	counter(&out.adminActions, MetricAdminActions, "{call}", "AdminService calls, by action and result (ok or the error reason).")
	var err error
	out.storeDuration, err = m.Float64Histogram(MetricStoreDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of store calls (retries included), by op and outcome: ok, or the error type."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
	errs = append(errs, err)
	out.inFlight, err = m.Int64ObservableUpDownCounter(MetricStoreInFlight, metric.WithUnit("{call}"),
		metric.WithDescription("Store operations in flight."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}
	return &out, nil
}

func attrs(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(kv...))
}

// errorType classifies a store error for the error.type attribute.
func errorType(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, storage.ErrUnavailable):
		return "unavailable"
	default:
		return "internal"
	}
}

// isAnswer reports whether err is one of the registry's answers rather
// than a failure of the store.
func isAnswer(err error) bool {
	return errors.Is(err, storage.ErrNotFound) || errors.Is(err, storage.ErrLeaseLost) ||
		errors.Is(err, storage.ErrAlreadyCompleted) || errors.Is(err, storage.ErrFingerprintMismatch)
}
