package client_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// TestAccessErrors checks that the registry's refusals (no credentials,
// another team's consumer, a rate limit, overload) come back as typed
// errors, from a real server with access control on.
func TestAccessErrors(t *testing.T) {
	set, err := access.Parse([]byte(`
identities:
  - name: billing
    token_hashes: ["` + access.HashToken("billing-secret") + `"]
    consumers: ["billing.*"]
rate_limits:
  - consumers: ["billing.limited"]
    rate: 0.001
    burst: 1
`))
	require.NoError(t, err)
	store, err := pebble.Open(t.TempDir(), pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	c := client.New(servertest.Start(t, store, server.Config{Access: set}))

	key := func(consumer string) client.ClaimParams {
		return client.ClaimParams{Key: client.Key{Consumer: consumer, Kind: client.KindOperation, Key: "k-1"}}
	}
	authed := metadata.AppendToOutgoingContext(t.Context(), "authorization", "bearer billing-secret")

	_, err = c.Claim(t.Context(), key("billing.payments"))
	require.ErrorIs(t, err, client.ErrUnauthenticated)
	require.Equal(t, codes.Unauthenticated, status.Code(err))

	_, err = c.Claim(authed, key("orders.inbox"))
	require.ErrorIs(t, err, client.ErrPermissionDenied)
	require.Equal(t, codes.PermissionDenied, status.Code(err))

	_, err = c.Claim(authed, key("billing.limited"))
	require.NoError(t, err, "the burst allows one call")
	_, err = c.Claim(authed, key("billing.limited"))
	require.ErrorIs(t, err, client.ErrRateLimited)
	var e *client.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, client.ReasonRateLimited, e.Reason)
	require.Greater(t, e.RetryAfter, time.Duration(0), "RATE_LIMITED carries the delay from RetryInfo")
	require.Equal(t, codes.ResourceExhausted, status.Code(err))
}

// TestQuotaError: a Claim of a new key for a consumer at its quota comes
// back as ErrQuotaExceeded, from a real server with a quota in its config.
func TestQuotaError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(path, []byte("consumers:\n  - {name: quota.c, max_records: 1}\n"), 0o600))
	src, err := configfile.Open(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	store, err := pebble.Open(t.TempDir(), pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	c := client.New(servertest.Start(t, store, server.Config{File: src}))
	key := func(k string) client.ClaimParams {
		return client.ClaimParams{Key: client.Key{Consumer: "quota.c", Kind: client.KindOperation, Key: k}}
	}
	_, err = c.Claim(t.Context(), key("k-1"))
	require.NoError(t, err)
	_, err = c.Claim(t.Context(), key("k-2"))
	require.ErrorIs(t, err, client.ErrQuotaExceeded)
	var e *client.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, client.ReasonQuotaExceeded, e.Reason)
	require.Equal(t, codes.ResourceExhausted, status.Code(err))
	_, err = c.Claim(t.Context(), key("k-1"))
	require.NoError(t, err, "its live key still works")
}
