package storechain_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/storage"
)

// capableStore has every optional capability; each call records the
// deadline it got.
type capableStore struct{ deadlines map[string]time.Time }

func (s *capableStore) saw(ctx context.Context, op string) {
	d, _ := ctx.Deadline()
	s.deadlines[op] = d
}

func (s *capableStore) Claim(ctx context.Context, _ storage.ClaimParams) (storage.ClaimResult, error) {
	s.saw(ctx, "Claim")
	return storage.ClaimResult{}, nil
}

func (s *capableStore) Complete(ctx context.Context, _ storage.CompleteParams) (storage.Record, error) {
	s.saw(ctx, "Complete")
	return storage.Record{}, nil
}

func (s *capableStore) Release(ctx context.Context, _ storage.ReleaseParams) (storage.Record, error) {
	s.saw(ctx, "Release")
	return storage.Record{}, nil
}

func (s *capableStore) Extend(ctx context.Context, _ storage.ExtendParams) (storage.Record, error) {
	s.saw(ctx, "Extend")
	return storage.Record{}, nil
}

func (s *capableStore) Park(ctx context.Context, _ storage.ParkParams) (storage.Record, error) {
	s.saw(ctx, "Park")
	return storage.Record{}, nil
}

func (s *capableStore) Lookup(ctx context.Context, _ storage.Key) (storage.Record, error) {
	s.saw(ctx, "Lookup")
	return storage.Record{}, nil
}

func (s *capableStore) Ping(ctx context.Context) error {
	s.saw(ctx, "Ping")
	return nil
}

func (s *capableStore) Close() error { return nil }

func (s *capableStore) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	s.saw(ctx, "ClaimBatch")
	return make([]storage.ClaimAnswer, len(ps))
}

func (s *capableStore) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	s.saw(ctx, "CompleteBatch")
	return make([]storage.CompleteAnswer, len(ps))
}

func (s *capableStore) Batch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	s.saw(ctx, "Batch")
	return make([]storage.OpAnswer, len(ops))
}

func (s *capableStore) Inspect(ctx context.Context, _ storage.Key) (storage.InspectResult, error) {
	s.saw(ctx, "Inspect")
	return storage.InspectResult{}, nil
}

func (s *capableStore) Invalidate(ctx context.Context, _ storage.InvalidateParams) (storage.Record, error) {
	s.saw(ctx, "Invalidate")
	return storage.Record{}, nil
}

func (s *capableStore) Resolve(ctx context.Context, _ storage.ResolveParams) (storage.Record, error) {
	s.saw(ctx, "Resolve")
	return storage.Record{}, nil
}

func (s *capableStore) List(ctx context.Context, _ storage.ListParams) (storage.ListResult, error) {
	s.saw(ctx, "List")
	return storage.ListResult{}, nil
}

func (s *capableStore) CountParked(ctx context.Context, _ string) (map[string]int64, error) {
	s.saw(ctx, "CountParked")
	return nil, nil
}

func (s *capableStore) SweepExpired(ctx context.Context, _ int) (storage.SweepResult, error) {
	s.saw(ctx, "SweepExpired")
	return storage.SweepResult{}, nil
}

func (s *capableStore) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	s.saw(ctx, "OldestExpiry")
	return time.Time{}, time.Time{}, false, nil
}

func (s *capableStore) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	s.saw(ctx, "ClaimKeyRing")
	return storage.ClaimKeyRing{Keys: []storage.ClaimKey{{Generation: 1, Key: make([]byte, storage.ClaimKeySize)}}}, nil
}

func (s *capableStore) RotateClaimKey(ctx context.Context, _ storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	s.saw(ctx, "RotateClaimKey")
	return storage.ClaimKeyRing{Keys: []storage.ClaimKey{{Generation: 1, Key: make([]byte, storage.ClaimKeySize)}}}, nil
}

func (s *capableStore) ConsumerUsage(ctx context.Context, _ []string) (map[string]storage.Usage, error) {
	s.saw(ctx, "ConsumerUsage")
	return nil, nil
}

// outcomes counts what the chain told readiness.
type outcomes struct{ ok, failed atomic.Int64 }

func (o *outcomes) record(err error) {
	if err == nil {
		o.ok.Add(1)
	} else {
		o.failed.Add(1)
	}
}

func testChain(t *testing.T, backend storage.Store) (*storechain.Chain, *outcomes) {
	t.Helper()
	out := &outcomes{}
	chain, err := storechain.New(backend, storechain.Config{MaxInFlight: 4, PerIdentity: 4,
		Meter: noop.NewMeterProvider().Meter("test"), Outcome: out.record})
	require.NoError(t, err)
	return chain, out
}

// TestStoreChainDecorates: every record operation, the admin's as the
// registry's, goes through the chain (it gets a deadline before the
// request's and readiness counts it); the rest reaches the backend
// untouched. The optional capabilities pass through to the backend.
func TestStoreChainDecorates(t *testing.T) {
	backend := &capableStore{deadlines: map[string]time.Time{}}
	chain, outcomes := testChain(t, backend)
	require.NotNil(t, chain.Admin())
	require.NotNil(t, chain.ClaimKeys())
	require.NotNil(t, chain.UsageCounter())

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	requestDeadline, _ := ctx.Deadline()
	k := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}
	for _, tc := range []struct {
		op        string
		call      func() error
		decorated bool
	}{
		{"Claim", func() error { _, err := chain.Claim(ctx, storage.ClaimParams{Key: k}); return err }, true},
		{"Complete", func() error { _, err := chain.Complete(ctx, storage.CompleteParams{Key: k}); return err }, true},
		{"Release", func() error { _, err := chain.Release(ctx, storage.ReleaseParams{Key: k}); return err }, true},
		{"Extend", func() error { _, err := chain.Extend(ctx, storage.ExtendParams{Key: k}); return err }, true},
		{"Park", func() error { _, err := chain.Park(ctx, storage.ParkParams{Key: k}); return err }, true},
		{"Lookup", func() error { _, err := chain.Lookup(ctx, k); return err }, true},
		{"ClaimBatch", func() error { storage.ClaimBatch(ctx, chain, []storage.ClaimParams{{Key: k}}); return nil }, true},
		{"CompleteBatch", func() error { storage.CompleteBatch(ctx, chain, []storage.CompleteParams{{Key: k}}); return nil }, true},
		{"Batch", func() error {
			storage.Batch(ctx, chain, []storage.Op{{Claim: &storage.ClaimParams{Key: k}}, {Complete: &storage.CompleteParams{Key: k}}})
			return nil
		}, true},
		{"Inspect", func() error { _, err := chain.Admin().Inspect(ctx, k); return err }, true},
		{"Invalidate", func() error { _, err := chain.Admin().Invalidate(ctx, storage.InvalidateParams{Key: k}); return err }, true},
		{"Resolve", func() error { _, err := chain.Admin().Resolve(ctx, storage.ResolveParams{Key: k}); return err }, true},
		{"List", func() error { _, err := chain.Admin().List(ctx, storage.ListParams{Consumer: "c"}); return err }, true},
		{"CountParked", func() error { _, err := chain.Admin().CountParked(ctx, ""); return err }, true},
		{"Ping", func() error { return chain.Ping(ctx) }, false},
		{"ClaimKeyRing", func() error { _, err := chain.ClaimKeys().ClaimKeyRing(ctx); return err }, false},
		{"RotateClaimKey", func() error {
			_, err := chain.ClaimKeys().RotateClaimKey(ctx, storage.RotateClaimKeyParams{})
			return err
		}, false},
		{"ConsumerUsage", func() error { _, err := chain.UsageCounter().ConsumerUsage(ctx, []string{"c"}); return err }, false},
		{"SweepExpired", func() error { _, err := chain.SweepExpired(ctx, 1); return err }, false},
		{"OldestExpiry", func() error { _, _, _, err := chain.OldestExpiry(ctx); return err }, false},
	} {
		t.Run(tc.op, func(t *testing.T) {
			before := outcomes.ok.Load()
			require.NoError(t, tc.call())
			got, ok := backend.deadlines[tc.op]
			require.True(t, ok, "the call reached the backend")
			if tc.decorated {
				require.True(t, got.Before(requestDeadline), "the store call's deadline is the request's less a margin")
				require.Equal(t, before+1, outcomes.ok.Load(), "readiness counted the call")
			} else {
				require.Equal(t, requestDeadline, got, "passed through with the request's deadline")
				require.Equal(t, before, outcomes.ok.Load(), "readiness did not count the call")
			}
		})
	}
}

// TestStoreChainCapabilities: the chain has a capability when the backend
// has it, whatever the chain itself implements.
func TestStoreChainCapabilities(t *testing.T) {
	bare := struct{ storage.Store }{&capableStore{deadlines: map[string]time.Time{}}}
	chain, _ := testChain(t, bare)
	require.Nil(t, chain.Admin())
	require.Nil(t, chain.ClaimKeys())
	require.Nil(t, chain.UsageCounter())
	_, err := chain.Inspect(t.Context(), storage.Key{})
	require.True(t, errors.Is(err, errors.ErrUnsupported), "a capability the backend lacks answers an error, not a panic: %v", err)
	require.Equal(t, idemregv1.ErrorReason_ERROR_REASON_INTERNAL, reason.Classify(err))
}

// batcherOnly is a store with ClaimBatch and CompleteBatch but no mixed
// Batch, which records the batches it got.
type batcherOnly struct {
	storage.Store
	calls []string
}

func (s *batcherOnly) ClaimBatch(_ context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	s.calls = append(s.calls, "claims")
	out := make([]storage.ClaimAnswer, len(ps))
	for i := range out {
		out[i].Result.Outcome = storage.OutcomeAcquired
	}
	return out
}

func (s *batcherOnly) CompleteBatch(_ context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	s.calls = append(s.calls, "completes")
	out := make([]storage.CompleteAnswer, len(ps))
	for i := range out {
		out[i].Err = storage.ErrLeaseLost
	}
	return out
}

// TestStoreChainBatch: a mixed batch is one record operation ("batch")
// through the chain, measured and counted by item: its Claims as Claims,
// its Completes as Completes (LEASE_LOST as complete's). On a backend with
// no mixed Batch it falls back to ClaimBatch and CompleteBatch in rounds
// that keep a key's order.
func TestStoreChainBatch(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	backend := &batcherOnly{Store: &capableStore{deadlines: map[string]time.Time{}}}
	chain, err := storechain.New(backend, storechain.Config{MaxInFlight: 4, PerIdentity: 4, Meter: mp.Meter("test")})
	require.NoError(t, err)
	k := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}
	other := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "other"}
	got := storage.Batch(t.Context(), chain, []storage.Op{
		{Complete: &storage.CompleteParams{Key: k}},
		{Claim: &storage.ClaimParams{Key: k}},
		{Claim: &storage.ClaimParams{Key: other}},
	})
	require.Len(t, got, 3)
	require.ErrorIs(t, got[0].Err, storage.ErrLeaseLost)
	require.Equal(t, storage.OutcomeAcquired, got[1].Claim.Outcome)
	require.Equal(t, storage.OutcomeAcquired, got[2].Claim.Outcome)
	require.Equal(t, []string{"completes", "claims", "claims"}, backend.calls, "k's Complete before its Claim, a round each")

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	sums := map[string]int64{}
	var batchSizes uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					name := m.Name
					for _, kv := range p.Attributes.ToSlice() {
						name += "/" + kv.Value.Emit()
					}
					sums[name] += p.Value
				}
			case metricdata.Histogram[int64]:
				for _, p := range d.DataPoints {
					if v, ok := p.Attributes.Value("method"); ok && v.AsString() == "batch" {
						batchSizes += p.Count
						require.EqualValues(t, 3, p.Sum)
					}
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					if v, ok := p.Attributes.Value("op"); ok && v.AsString() == "batch" {
						require.EqualValues(t, 1, p.Count, "one store operation")
					}
				}
			}
		}
	}
	require.EqualValues(t, 1, batchSizes, "one batch recorded")
	require.EqualValues(t, 2, sums[storechain.MetricClaims+"/"+storechain.ClaimAcquired])
	require.EqualValues(t, 1, sums[storechain.MetricLeaseLost+"/complete"])
}

// blockingStore holds every Claim until release is closed.
type blockingStore struct {
	capableStore
	entered chan struct{}
	release chan struct{}
}

func (s *blockingStore) Claim(ctx context.Context, _ storage.ClaimParams) (storage.ClaimResult, error) {
	s.entered <- struct{}{}
	<-s.release
	return storage.ClaimResult{}, nil
}

type identityKey struct{}

// TestInFlightBounds: beyond an identity's share, and beyond the server's
// bound, a record operation is refused at once, with the error that names
// the bound, and without reaching the store; the slots come back when the
// calls end.
func TestInFlightBounds(t *testing.T) {
	backend := &blockingStore{capableStore: capableStore{deadlines: map[string]time.Time{}},
		entered: make(chan struct{}, 8), release: make(chan struct{})}
	chain, err := storechain.New(backend, storechain.Config{MaxInFlight: 2, PerIdentity: 1,
		Meter:    noop.NewMeterProvider().Meter("test"),
		Identity: func(ctx context.Context) string { s, _ := ctx.Value(identityKey{}).(string); return s }})
	require.NoError(t, err)
	as := func(id string) context.Context { return context.WithValue(t.Context(), identityKey{}, id) }
	var wg sync.WaitGroup
	claim := func(ctx context.Context) error { _, err := chain.Claim(ctx, storage.ClaimParams{}); return err }
	wg.Go(func() { require.NoError(t, claim(as("a"))) })
	<-backend.entered
	var share *storechain.ShareExceeded
	require.ErrorAs(t, claim(as("a")), &share, "a's share is one")
	require.Equal(t, storechain.ShareExceeded{Identity: "a", Share: 1}, *share)
	require.ErrorIs(t, share, storechain.ErrOverloaded)
	wg.Go(func() { require.NoError(t, claim(as("b"))) })
	<-backend.entered
	err = claim(as(""))
	require.ErrorIs(t, err, storechain.ErrOverloaded, "the server's bound of two")
	require.False(t, errors.As(err, &share), "not an identity's share")
	close(backend.release)
	wg.Wait()
	require.NoError(t, claim(as("a")), "the slots came back")
}
