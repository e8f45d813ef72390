package server

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// Limits are the bounds a request must respect and the defaults it gets.
type Limits struct {
	// DefaultLease applies when a Claim or Extend gives none.
	DefaultLease time.Duration
	// MinLease and MaxLease bound a requested lease.
	MinLease, MaxLease time.Duration
	// DefaultMessageRetention and DefaultOperationRetention apply when a
	// Claim gives none, by kind.
	DefaultMessageRetention, DefaultOperationRetention time.Duration
	// MinRetention and MaxRetention bound a requested retention.
	MinRetention, MaxRetention time.Duration
	// MaxResultBytes bounds the encoded size of a stored result.
	MaxResultBytes int
	// MaxLeaseTotal bounds how long one attempt may hold a key, its Claim's
	// lease and every Extend together (storage.LeaseNotAfter); zero means
	// no bound.
	MaxLeaseTotal time.Duration
}

// Default limits, documented in docs/semantics.md.
const (
	DefaultLease              = 30 * time.Second
	DefaultMinLease           = time.Second
	DefaultMaxLease           = time.Hour
	DefaultMessageRetention   = 7 * 24 * time.Hour
	DefaultOperationRetention = 24 * time.Hour
	// DefaultMinRetention keeps every record far longer than any plausible
	// clock skew between store nodes, which token monotonicity after expiry
	// relies on (see storage.NextToken).
	DefaultMinRetention   = time.Minute
	DefaultMaxRetention   = 30 * 24 * time.Hour
	DefaultMaxResultBytes = 1 << 20
	// DefaultMaxLeaseTotal lets a holder that keeps extending work on one
	// key for a day, far beyond any one handler's plausible run, so that a
	// stuck but alive holder (a loop that heartbeats and never finishes)
	// gives the key back within a day rather than never.
	DefaultMaxLeaseTotal = 24 * time.Hour
)

// Fixed limits of the API, documented in the proto.
const (
	MaxConsumerBytes    = storage.MaxConsumerBytes
	MaxKeyBytes         = 256
	MaxFingerprintBytes = 64
	MaxHolderBytes      = 128
	MaxParkReasonBytes  = 512
	MaxRequestIDBytes   = 128
)

// DefaultLimits returns the limits used when none are configured.
func DefaultLimits() Limits {
	return Limits{
		DefaultLease:              DefaultLease,
		MinLease:                  DefaultMinLease,
		MaxLease:                  DefaultMaxLease,
		DefaultMessageRetention:   DefaultMessageRetention,
		DefaultOperationRetention: DefaultOperationRetention,
		MinRetention:              DefaultMinRetention,
		MaxRetention:              DefaultMaxRetention,
		MaxResultBytes:            DefaultMaxResultBytes,
		MaxLeaseTotal:             DefaultMaxLeaseTotal,
	}
}

// Validate reports limits that contradict each other.
func (l Limits) Validate() error {
	var errs []error
	if l.MinLease <= 0 || l.MinLease > l.MaxLease {
		errs = append(errs, fmt.Errorf("lease bounds: need 0 < min (%v) <= max (%v)", l.MinLease, l.MaxLease))
	}
	if l.DefaultLease < l.MinLease || l.DefaultLease > l.MaxLease {
		errs = append(errs, fmt.Errorf("default lease %v outside [%v, %v]", l.DefaultLease, l.MinLease, l.MaxLease))
	}
	if l.MinRetention <= 0 || l.MinRetention > l.MaxRetention {
		errs = append(errs, fmt.Errorf("retention bounds: need 0 < min (%v) <= max (%v)", l.MinRetention, l.MaxRetention))
	}
	for _, d := range []time.Duration{l.DefaultMessageRetention, l.DefaultOperationRetention} {
		if d < l.MinRetention || d > l.MaxRetention {
			errs = append(errs, fmt.Errorf("default retention %v outside [%v, %v]", d, l.MinRetention, l.MaxRetention))
		}
	}
	if l.MaxLeaseTotal < 0 || (l.MaxLeaseTotal > 0 && l.MaxLeaseTotal < l.MaxLease) {
		errs = append(errs, fmt.Errorf("max lease total %v must be at least the max lease %v (0: no bound)", l.MaxLeaseTotal, l.MaxLease))
	}
	if l.MaxResultBytes <= 0 {
		errs = append(errs, fmt.Errorf("max result bytes must be positive, got %d", l.MaxResultBytes))
	}
	return errors.Join(errs...)
}

// Policy returns the lease and retention bounds of l as the policy of
// every consumer: the base a policy file overrides.
func (l Limits) Policy() policy.Policy {
	return policy.Policy{
		Source:             policy.DefaultsSource,
		Lease:              policy.Bounds{Default: l.DefaultLease, Min: l.MinLease, Max: l.MaxLease},
		MessageRetention:   policy.Bounds{Default: l.DefaultMessageRetention, Min: l.MinRetention, Max: l.MaxRetention},
		OperationRetention: policy.Bounds{Default: l.DefaultOperationRetention, Min: l.MinRetention, Max: l.MaxRetention},
		MaxLeaseTotal:      l.MaxLeaseTotal,
	}
}

// Bounds on what a request can make the server write in a log line or a
// status (server/internal/reason; docs/operations.md, "Log and error
// bounds").
const (
	MaxEchoedFieldBytes   = reason.MaxEchoedFieldBytes
	MaxStatusMessageBytes = reason.MaxStatusMessageBytes
)
