package server

import (
	"context"

	"go.opentelemetry.io/otel/metric/noop"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/storage"
)

// RefreshQuotas runs one refresh of srv's quota usage now, as its loop
// does every QuotaRefresh.
func RefreshQuotas(ctx context.Context, srv *Server) error { return srv.svc.quotas.Refresh(ctx) }

// QuotaRefreshes reports srv's quota refreshes so far, done and failed,
// and whether its refresh loop runs.
func QuotaRefreshes(srv *Server) (done, failed int64, running bool) {
	return srv.svc.quotas.Stats()
}

// QuotaUsage is what srv knows of consumer's usage; ok is false when it
// does not follow the consumer.
func QuotaUsage(srv *Server, consumer string) (records, bytes int64, ok bool) {
	return srv.svc.quotas.Usage(consumer)
}

// WithoutQuotaWake keeps srv's refresh loop from counting a consumer as
// soon as it is first seen, so that a test's counts come from its own
// RefreshQuotas calls alone. Call it before Serve.
func WithoutQuotaWake(srv *Server) { srv.svc.quotas.WithoutWake() }

// CountParkedNow counts srv's parked records for its gauge now, as its
// loop does every ParkedCountInterval.
func CountParkedNow(ctx context.Context, srv *Server) error { return srv.parked.count(ctx) }

// NewAdminService returns the AdminService on store as New registers it,
// for tests that call its handlers directly; they give it a context from
// AsAnonymous, as the interceptors would.
func NewAdminService(store storage.Store, limits Limits) (*AdminService, error) {
	m, err := newMetrics(noop.NewMeterProvider())
	if err != nil {
		return nil, err
	}
	chain, err := storechain.New(store, storechain.Config{MaxInFlight: DefaultMaxInFlight, PerIdentity: DefaultMaxInFlight, Meter: m.meter})
	if err != nil {
		return nil, err
	}
	svc, err := newService(chain, limits, nil, nil, m, serviceBounds{})
	if err != nil {
		return nil, err
	}
	return newAdminService(svc, nil), nil
}

// AsAnonymous is ctx as the interceptors leave it for a caller of an open
// server.
func AsAnonymous(ctx context.Context) context.Context {
	return context.WithValue(ctx, identityKey{}, access.Anonymous)
}
