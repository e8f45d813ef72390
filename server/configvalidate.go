package server

import (
	"cmp"
	"errors"
	"fmt"
	"time"
)

// A ConfigError is a field of Config whose value cannot work. Field names
// it as Config does ("WaitRecheck", "Keepalive.MaxConnectionAge"), so that
// a program that sets the fields from flags or a file can name its own
// setting instead.
type ConfigError struct {
	Field   string
	Value   any
	Problem string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("%s %s, got %v", e.Field, e.Problem, e.Value)
}

// Validate reports the settings of c that cannot work, each field's as a
// *ConfigError; Limits, Bounds and Readiness report theirs through their
// own Validate. Zero fields are valid, as they take the defaults, and so
// are the negative values documented to turn something off
// (ParkedCountInterval, StreamWorkers). New calls it.
func (c Config) Validate() error {
	var errs []error
	bad := func(field string, value any, problem string) {
		errs = append(errs, &ConfigError{Field: field, Value: value, Problem: problem})
	}
	if c.Limits != (Limits{}) {
		errs = append(errs, c.Limits.Validate())
	}
	k := c.Keepalive
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"HealthInterval", c.HealthInterval}, {"PingTimeout", c.PingTimeout},
		{"RequestTimeout", c.RequestTimeout}, {"MaxRequestTimeout", c.MaxRequestTimeout},
		{"WaitRecheck", c.WaitRecheck}, {"QuotaRefresh", c.QuotaRefresh},
		{"DrainDelay", c.DrainDelay}, {"ShutdownTimeout", c.ShutdownTimeout},
		{"Keepalive.MaxConnectionIdle", k.MaxConnectionIdle}, {"Keepalive.MaxConnectionAge", k.MaxConnectionAge},
		{"Keepalive.MaxConnectionAgeGrace", k.MaxConnectionAgeGrace}, {"Keepalive.Time", k.Time}, {"Keepalive.Timeout", k.Timeout},
	} {
		if d.v < 0 {
			bad(d.field, d.v, "must not be negative")
		}
	}
	for _, n := range []struct {
		field string
		v     int
	}{{"MaxInFlight", c.MaxInFlight}, {"MaxInFlightPerIdentity", c.MaxInFlightPerIdentity}, {"MaxWaiters", c.MaxWaiters},
		{"MaxWaitersPerIdentity", c.MaxWaitersPerIdentity}, {"MaxQuotaConsumersPerIdentity", c.MaxQuotaConsumersPerIdentity}} {
		if n.v < 0 {
			bad(n.field, n.v, "must not be negative")
		}
	}
	// A deadline cut to below the budget of a request without one would
	// make a caller's explicit deadline shorter than not giving any.
	if c.RequestTimeout >= 0 && c.MaxRequestTimeout >= 0 {
		budget := cmp.Or(c.RequestTimeout, DefaultRequestTimeout)
		if most := cmp.Or(c.MaxRequestTimeout, DefaultMaxRequestTimeout); most < budget {
			bad("MaxRequestTimeout", most, fmt.Sprintf("must be at least the request timeout (%v)", budget))
		}
	}
	// Below a millisecond a waiter spins on the store; above MaxWait it
	// would never look before its wait ends.
	if w := c.WaitRecheck; w > 0 && (w < time.Millisecond || w > MaxWait) {
		bad("WaitRecheck", w, fmt.Sprintf("must be between 1ms and %v, the longest wait", MaxWait))
	}
	errs = append(errs, c.Bounds.Validate(), c.Readiness.Validate())
	return errors.Join(errs...)
}
