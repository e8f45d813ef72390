package server_test

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   server.Config
		field string // of the *server.ConfigError, when the field is Config's own
		err   string
	}{
		{name: "zero takes the defaults", cfg: server.Config{}},
		{name: "off where documented", cfg: server.Config{ParkedCountInterval: -1, StreamWorkers: -1}},
		{name: "budget within the cap", cfg: server.Config{RequestTimeout: 30 * time.Second, MaxRequestTimeout: 30 * time.Second}},
		{name: "cap below the budget", cfg: server.Config{RequestTimeout: 10 * time.Second, MaxRequestTimeout: 5 * time.Second},
			field: "MaxRequestTimeout", err: "MaxRequestTimeout must be at least the request timeout (10s), got 5s"},
		{name: "budget above the default cap", cfg: server.Config{RequestTimeout: time.Minute},
			field: "MaxRequestTimeout", err: "the request timeout (1m0s), got 30s"},
		{name: "negative request timeout", cfg: server.Config{RequestTimeout: -time.Second}, field: "RequestTimeout", err: "must not be negative"},
		{name: "negative in-flight bound", cfg: server.Config{MaxInFlight: -1}, field: "MaxInFlight", err: "must not be negative"},
		{name: "negative waiters", cfg: server.Config{MaxWaiters: -1}, field: "MaxWaiters", err: "must not be negative"},
		{name: "re-check spins", cfg: server.Config{WaitRecheck: time.Microsecond}, field: "WaitRecheck", err: "must be between 1ms and 30s"},
		{name: "re-check never", cfg: server.Config{WaitRecheck: time.Minute}, field: "WaitRecheck", err: "must be between 1ms and 30s"},
		{name: "refusal rate NaN", cfg: server.Config{RefusalRate: math.NaN()}, field: "RefusalRate", err: "must be a finite number"},
		{name: "refusal rate infinite", cfg: server.Config{RefusalRate: math.Inf(1)}, field: "RefusalRate", err: "must be a finite number"},
		{name: "keepalive defaults", cfg: server.Config{Keepalive: server.DefaultKeepalive()}},
		{name: "negative connection age", cfg: func() server.Config {
			c := server.Config{Keepalive: server.DefaultKeepalive()}
			c.Keepalive.MaxConnectionAge = -time.Second
			return c
		}(), field: "Keepalive.MaxConnectionAge", err: "must not be negative"},
		{name: "limits", cfg: server.Config{Limits: server.Limits{MinLease: time.Hour, MaxLease: time.Minute}}, err: "lease bounds"},
		{name: "bounds", cfg: server.Config{Bounds: server.Bounds{MaxHeaderListSize: 512}}, err: "header list bound"},
		{name: "readiness", cfg: server.Config{Readiness: server.Readiness{MaxFailureRatio: 2}}, err: "failure ratio"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
			if tc.field != "" {
				var ce *server.ConfigError
				require.True(t, errors.As(err, &ce), "%v", err)
				require.Equal(t, tc.field, ce.Field)
			}
			_, err = server.New(memStore(t), tc.cfg)
			require.ErrorContains(t, err, tc.err, "New refuses it too")
		})
	}
}
