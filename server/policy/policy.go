// Package policy owns the retention policy: for each consumer, the lease and
// the retention of each kind that a request gets when it gives none, and the
// bounds a request must stay within.
//
// A Set holds the server's defaults and the consumers' policies, matched by
// exact name or by prefix (the longest prefix wins, an exact name beats any
// prefix). Sets are read from a YAML or JSON file (Parse, Load) and replaced
// whole on reload (Source): a request sees one set, never a mix of two.
package policy

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Bounds are a default and the inclusive range a requested value must lie in.
type Bounds struct {
	Default, Min, Max time.Duration
}

// Policy is what applies to the requests of one consumer.
type Policy struct {
	// Source names where the policy comes from, for messages:
	// "the server defaults", `consumer "billing.worker"`, `prefix "orders."`.
	Source string
	// Lease bounds the lease of a Claim or an Extend.
	Lease Bounds
	// MessageRetention and OperationRetention bound the retention of a
	// Claim of each kind.
	MessageRetention, OperationRetention Bounds
	// MaxLeaseTotal bounds how long one attempt may hold a key, its Claim's
	// lease and every Extend together; zero means no bound.
	MaxLeaseTotal time.Duration
	// MaxRecords and MaxBytes are the consumer's quotas: once its live
	// records (or their storage.RecordBytes) are known to reach them, a
	// Claim that would create a new key is refused. Zero means no quota.
	// Each consumer matching an entry has a quota of its own: a prefix's
	// quota is not shared by the consumers under it.
	MaxRecords, MaxBytes int64
	// MaxAttempts bounds how many times a key may be acquired: a Claim
	// that would take over a record already acquired that many times
	// parks it instead (storage.ClaimParams.MaxAttempts). Zero means no
	// bound.
	MaxAttempts int64
}

// HasQuota reports whether p sets a quota.
func (p Policy) HasQuota() bool { return p.MaxRecords > 0 || p.MaxBytes > 0 }

// Retention returns the retention bounds of kind k.
func (p Policy) Retention(k storage.Kind) Bounds {
	if k == storage.KindMessage {
		return p.MessageRetention
	}
	return p.OperationRetention
}

// RetentionField is the name of k's retention bounds in a policy file.
func RetentionField(k storage.Kind) string {
	if k == storage.KindMessage {
		return "message_retention"
	}
	return "operation_retention"
}

// Validate reports bounds that contradict each other.
func (p Policy) Validate() error {
	var errs []string
	for _, b := range []struct {
		name string
		b    Bounds
	}{{"lease", p.Lease}, {"message_retention", p.MessageRetention}, {"operation_retention", p.OperationRetention}} {
		switch {
		case b.b.Min <= 0:
			errs = append(errs, fmt.Sprintf("%s.min must be positive, got %s", b.name, FormatDuration(b.b.Min)))
		case b.b.Max < b.b.Min:
			errs = append(errs, fmt.Sprintf("%s.max %s is below %s.min %s", b.name, FormatDuration(b.b.Max), b.name, FormatDuration(b.b.Min)))
		case b.b.Default < b.b.Min:
			errs = append(errs, fmt.Sprintf("%s.default %s is below %s.min %s", b.name, FormatDuration(b.b.Default), b.name, FormatDuration(b.b.Min)))
		case b.b.Default > b.b.Max:
			errs = append(errs, fmt.Sprintf("%s.default %s is above %s.max %s", b.name, FormatDuration(b.b.Default), b.name, FormatDuration(b.b.Max)))
		}
	}
	switch {
	case p.MaxLeaseTotal < 0:
		errs = append(errs, fmt.Sprintf("max_lease_total must not be negative, got %s", FormatDuration(p.MaxLeaseTotal)))
	case p.MaxLeaseTotal > 0 && p.MaxLeaseTotal < p.Lease.Max:
		errs = append(errs, fmt.Sprintf("max_lease_total %s is below lease.max %s: a Claim could ask for more than an attempt may hold",
			FormatDuration(p.MaxLeaseTotal), FormatDuration(p.Lease.Max)))
	}
	if p.MaxRecords < 0 {
		errs = append(errs, fmt.Sprintf("max_records must not be negative (0: no quota), got %d", p.MaxRecords))
	}
	if p.MaxAttempts < 0 {
		errs = append(errs, fmt.Sprintf("max_attempts must not be negative (0: unbounded), got %d", p.MaxAttempts))
	}
	if p.MaxBytes < 0 {
		errs = append(errs, fmt.Sprintf("max_bytes must not be negative (0: no quota), got %d", p.MaxBytes))
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%s: %s", p.Source, strings.Join(errs, "; "))
}

// Set is an immutable set of policies: the server's defaults and the
// consumers' own.
type Set struct {
	defaults Policy
	exact    map[string]Policy
	// prefixes are sorted longest first, so the first match is the longest.
	prefixes []prefixPolicy
}

type prefixPolicy struct {
	prefix string
	policy Policy
}

// NewSet returns a set in which every consumer gets defaults.
func NewSet(defaults Policy) (*Set, error) {
	if defaults.Source == "" {
		defaults.Source = DefaultsSource
	}
	if err := defaults.Validate(); err != nil {
		return nil, err
	}
	return &Set{defaults: defaults, exact: map[string]Policy{}}, nil
}

// DefaultsSource is the Source of the server's defaults.
const DefaultsSource = "the server defaults"

// For returns the policy of consumer: its exact entry, else the entry of its
// longest matching prefix, else the defaults.
func (s *Set) For(consumer string) Policy {
	if p, ok := s.exact[consumer]; ok {
		return p
	}
	for _, pp := range s.prefixes {
		if strings.HasPrefix(consumer, pp.prefix) {
			return pp.policy
		}
	}
	return s.defaults
}

// Defaults returns the policy of consumers without one of their own.
func (s *Set) Defaults() Policy { return s.defaults }

// Len returns the number of consumer entries (names and prefixes).
func (s *Set) Len() int { return len(s.exact) + len(s.prefixes) }

// LongestLease is the largest lease.max of the defaults and of every
// consumer entry: the longest a claim may be held, under this set,
// without an Extend. A rotation's grace must cover it (idemreg
// rotate-claim-key).
func (s *Set) LongestLease() time.Duration {
	longest := s.defaults.Lease.Max
	for _, p := range s.exact {
		longest = max(longest, p.Lease.Max)
	}
	for _, pp := range s.prefixes {
		longest = max(longest, pp.policy.Lease.Max)
	}
	return longest
}

func (s *Set) sortPrefixes() {
	slices.SortFunc(s.prefixes, func(a, b prefixPolicy) int {
		if c := cmp.Compare(len(b.prefix), len(a.prefix)); c != 0 {
			return c
		}
		return strings.Compare(a.prefix, b.prefix)
	})
}

// FormatDuration writes d the way a policy file may: whole days as "7d",
// anything else as Go writes durations ("36h0m0s", "1m30s").
func FormatDuration(d time.Duration) string {
	const day = 24 * time.Hour
	if d > 0 && d%day == 0 {
		return strconv.FormatInt(int64(d/day), 10) + "d"
	}
	return d.String()
}

// durationSyntax says what ParseDuration takes, for its errors.
const durationSyntax = `a duration is a number and a unit (ns, us, ms, s, m, h; d for days, first), like "90s", "1h30m", "7d" or "1d12h"`

// ParseDuration reads a duration as Go writes them ("90s", "1h30m"), with
// days as an optional leading term ("7d", "1d12h"). A day is 24 hours.
// Every command-line flag and environment variable of a duration reads it
// here too, so that what the config file and the docs write is taken
// everywhere.
func ParseDuration(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	days, rest, found := strings.Cut(s, "d")
	if !found {
		d, err := time.ParseDuration(s)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q: %s", s, durationSyntax)
		}
		return d, nil
	}
	const day = 24 * time.Hour
	n, err := strconv.ParseInt(days, 10, 64)
	if err != nil || n < 0 || strings.HasPrefix(days, "+") {
		return 0, fmt.Errorf("invalid duration %q: days must be a whole number; %s", s, durationSyntax)
	}
	if n > int64(math.MaxInt64/day) {
		return 0, fmt.Errorf("invalid duration %q: longer than %d days", s, int64(math.MaxInt64/day))
	}
	d := time.Duration(n) * day
	if rest != "" {
		r, err := time.ParseDuration(rest)
		if err != nil || r < 0 {
			return 0, fmt.Errorf("invalid duration %q: after the days, a duration like \"12h\"; %s", s, durationSyntax)
		}
		if r > math.MaxInt64-d {
			return 0, fmt.Errorf("invalid duration %q: too long", s)
		}
		d += r
	}
	return d, nil
}
