package sweepcmd

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/retention"
)

// TestSummary: the line sweep prints says how the pass ended, what it
// deleted and how fast, and what is left: nothing, a backlog (how late the
// oldest record is, by the store's clock), or when the next record
// expires.
func TestSummary(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	pass := retention.Result{Stop: retention.StopFinished, Deleted: 2500, Batches: 3, Duration: 2 * time.Second, StoreNow: now}
	require.Equal(t, "sweep finished: deleted 2500 expired records in 3 batches (0 failed) in 2s (1250.0/s); no record is left", summary(pass))

	pass.Stop, pass.Errors, pass.HasOldest, pass.Oldest = retention.StopMaxDuration, 1, true, now.Add(-90*time.Minute)
	require.Equal(t, "sweep max_duration: deleted 2500 expired records in 3 batches (1 failed) in 2s (1250.0/s); the oldest record left expired 1h30m0s ago", summary(pass))

	pass.Stop, pass.Errors, pass.Oldest = retention.StopFinished, 0, now.Add(time.Hour)
	require.Equal(t, "sweep finished: deleted 2500 expired records in 3 batches (0 failed) in 2s (1250.0/s); the next record expires at 2026-12-05T13:00:00Z", summary(pass))
}
