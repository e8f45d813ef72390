package server

import (
	"context"

	"go.opentelemetry.io/otel/metric/noop"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/storage"
)

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
