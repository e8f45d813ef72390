package server

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/storage"
)

// TestReadinessCountsOnlyStoreFailures: what the registry answers and what
// a caller decides must not make a replica unready, or any caller could
// turn every replica away; only the store failing counts. The errors are
// those the stores return (wrapped as they wrap them).
func TestReadinessCountsOnlyStoreFailures(t *testing.T) {
	for _, tc := range []struct {
		name   string
		err    error
		ok     int64
		failed int64
	}{
		{name: "success", err: nil, ok: 1},
		{name: "not found", err: fmt.Errorf("pebble lookup: %w", storage.ErrNotFound), ok: 1},
		{name: "lease lost (fenced)", err: storage.ErrLeaseLost, ok: 1},
		{name: "already completed", err: storage.ErrAlreadyCompleted, ok: 1},
		{name: "fingerprint mismatch", err: storage.ErrFingerprintMismatch, ok: 1},
		{name: "store unavailable", err: fmt.Errorf("%w: postgres claim: %w", storage.ErrUnavailable, fmt.Errorf("ERROR: could not extend file (SQLSTATE 53100)")), failed: 1},
		{name: "caller's deadline", err: fmt.Errorf("postgres claim: %w", context.DeadlineExceeded)},
		{name: "caller's deadline mid-statement", err: fmt.Errorf("%w: %w", storage.ErrUnavailable, context.DeadlineExceeded)},
		{name: "caller cancelled", err: fmt.Errorf("postgres claim: %w: %w", context.Canceled, storage.ErrUnavailable)},
		{name: "overloaded before the store", err: storechain.ErrOverloaded},
		{name: "internal", err: fmt.Errorf("something else")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c callOutcomes
			c.record(tc.err)
			require.Equal(t, tc.ok, c.ok.Load(), "counted as the store answering")
			require.Equal(t, tc.failed, c.failed.Load(), "counted as the store failing")
		})
	}
}

// TestReadinessWindow: the failure rate is counted over the last Window
// intervals, only from MinCalls calls on, and old intervals fall out.
func TestReadinessWindow(t *testing.T) {
	type interval struct{ ok, failed int64 }
	for _, tc := range []struct {
		name      string
		intervals []interval
		failing   []bool // after each interval
	}{
		{name: "healthy", intervals: []interval{{10, 0}, {10, 1}}, failing: []bool{false, false}},
		{name: "too few calls say nothing", intervals: []interval{{0, 4}}, failing: []bool{false}},
		{name: "enough failures across intervals", intervals: []interval{{0, 3}, {0, 3}}, failing: []bool{false, true}},
		{name: "at the ratio", intervals: []interval{{5, 5}}, failing: []bool{true}},
		{name: "below the ratio", intervals: []interval{{6, 4}}, failing: []bool{false}},
		{name: "successes bring it back", intervals: []interval{{0, 10}, {30, 0}}, failing: []bool{true, false}},
		{name: "failures age out", intervals: []interval{{0, 10}, {}, {}, {}}, failing: []bool{true, true, true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newReadinessWindow(Readiness{Window: 3, MinCalls: 5, MaxFailureRatio: 0.5})
			for i, iv := range tc.intervals {
				var c callOutcomes
				c.ok.Store(iv.ok)
				c.failed.Store(iv.failed)
				_, failing := w.add(&c)
				require.Equal(t, tc.failing[i], failing, "after interval %d", i)
				require.Zero(t, c.ok.Load()+c.failed.Load(), "an interval's counts are taken")
			}
		})
	}
}

func TestReadinessValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    Readiness
		err  string
	}{
		{name: "zero takes the defaults", r: Readiness{}},
		{name: "negative window", r: Readiness{Window: -1}, err: "window"},
		{name: "negative minimum", r: Readiness{MinCalls: -1}, err: "minimum"},
		{name: "ratio above one", r: Readiness{MaxFailureRatio: 1.5}, err: "ratio"},
		{name: "negative ratio", r: Readiness{MaxFailureRatio: -0.1}, err: "ratio"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.r.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
		})
	}
}
