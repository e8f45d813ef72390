package storagetest

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// Factory returns a new, empty store whose clock is moved by clock. The
// factory registers the store's cleanup with t.
type Factory func(t *testing.T, clock *Clock) storage.Store

// Option changes how All runs the suite.
type Option func(*options)

type options struct {
	shared Factory
	except map[string]string // area → why it is skipped
}

// Shared gives the areas whose cases use keys and consumers of their own
// (every area but Sweeper, ClaimKeys and Membership, whose cases count
// what the store holds) a factory whose stores may already hold other
// cases' records: a backend whose empty store is costly to make (a
// database of its own) opens them all on one.
func Shared(newStore Factory) Option {
	return func(o *options) { o.shared = newStore }
}

// Except skips the area named name, saying why: for a configuration of a
// backend that cannot meet the area's cases as they stand, while another
// configuration of it runs them.
func Except(name, reason string) Option {
	return func(o *options) {
		if o.except == nil {
			o.except = map[string]string{}
		}
		o.except[name] = reason
	}
}

// area is one part of the suite: the cases of one capability, run as a
// subtest named after it.
type area struct {
	name       string
	capability string // the interface the cases need, as Go spells it
	has        func(storage.Store) bool
	// ownStore: every case needs an empty store of its own.
	ownStore bool
	run      func(t *testing.T, newStore Factory)
}

// areaOf is the area of the cases of capability C.
func areaOf[C any](name string, ownStore bool, cases []testCase[C]) area {
	return area{
		name:       name,
		capability: reflect.TypeFor[C]().String(),
		has:        func(s storage.Store) bool { _, ok := s.(C); return ok },
		ownStore:   ownStore,
		run:        func(t *testing.T, newStore Factory) { runCases(t, newStore, cases) },
	}
}

// areas is the whole suite, in the order All runs it.
func areas() []area {
	return []area{
		areaOf("Store", false, storeCases()),
		areaOf("Sweeper", true, sweeperCases),
		areaOf("Batcher", false, batcherCases),
		areaOf("MixedBatcher", false, mixedBatcherCases),
		areaOf("ClaimKeys", true, withoutStore(claimKeysCases)),
		areaOf("WaitMarker", false, waitMarkerCases),
		areaOf("Membership", true, withoutStore(membershipCases)),
		areaOf("Admin", false, adminCases()),
		areaOf("Usage", false, usageCases),
	}
}

// All runs every area of the suite that the stores newStore makes can
// run, each as a subtest named after it: the cases of storage.Store, then
// those of each optional capability. An area whose capability the store
// lacks is skipped, and the skip names the missing interface, so that a
// backend's one call is its whole specification and what it leaves out
// shows in the test log rather than in a runner nobody called (the
// CockroachDB run once left the batch path and key rotation unspecified
// that way).
//
// newStore must return an empty store on every call; Shared names a
// cheaper factory for the areas that do not need one.
func All(t *testing.T, newStore Factory, opts ...Option) {
	t.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	for _, a := range areas() {
		factory := newStore
		if o.shared != nil && !a.ownStore {
			factory = o.shared
		}
		if reason, ok := o.except[a.name]; ok {
			t.Run(a.name, func(t *testing.T) { t.Skipf("the %s cases were not run: %s", a.name, reason) })
			continue
		}
		t.Run(a.name, func(t *testing.T) {
			// A capability is the store's type's: one store of the
			// factory answers for all it makes.
			if s := factory(t, &Clock{}); !a.has(s) {
				t.Skipf("%T does not implement %s: the %s cases were not run", s, a.capability, a.name)
			}
			a.run(t, factory)
		})
	}
}

// testCase is one case of an area: fn gets the store both as itself and
// as the capability C the area is about.
type testCase[C any] struct {
	name string
	fn   func(t *testing.T, s storage.Store, capability C, c *Clock)
}

// capabilityCase is a case that needs only the capability.
type capabilityCase[C any] struct {
	name string
	fn   func(t *testing.T, capability C, c *Clock)
}

func withoutStore[C any](cases []capabilityCase[C]) []testCase[C] {
	out := make([]testCase[C], 0, len(cases))
	for _, tc := range cases {
		out = append(out, testCase[C]{tc.name, func(t *testing.T, _ storage.Store, capability C, c *Clock) { tc.fn(t, capability, c) }})
	}
	return out
}

// runCases runs each case on a store of its own from newStore.
func runCases[C any](t *testing.T, newStore Factory, cases []testCase[C]) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := &Clock{}
			s := newStore(t, c)
			capability, ok := s.(C)
			require.True(t, ok, "%T does not implement %s", s, reflect.TypeFor[C]())
			tc.fn(t, s, capability, c)
		})
	}
}
