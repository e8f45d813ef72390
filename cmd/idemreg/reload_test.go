package main

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
)

// TestServeConfigReloadIsAtomic: a SIGHUP takes the config file whole or
// not at all. A file whose policy part is valid and whose access part is
// not changes neither part; a valid file changes both.
func TestServeConfigReloadIsAtomic(t *testing.T) {
	bin := buildBinary(t)
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	identity := func(consumers string) string {
		return "identities:\n  - {name: orders, token_hashes: [\"" + access.HashToken("orders-token") + "\"], consumers: [" + consumers + "]}\n"
	}
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	strictPolicy := "consumers:\n  - prefix: orders.\n    message_retention: {min: 8d, default: 10d}\n"
	loosePolicy := "consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 10d}\n"
	write(strictPolicy + identity(`"orders.*"`))
	p := startServe(t, bin, t.TempDir(), nil, "--config", path)
	p.waitLog(t, "serving")

	c := idemregv1.NewRegistryServiceClient(dial(t, p.addr))
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "bearer orders-token")
	n := 0
	claim := func(consumer string, retention time.Duration) error {
		n++
		_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: "m-" + string(rune('a'+n)), Retention: durationpb.New(retention)})
		return err
	}
	// policyLoose: a 2h retention is allowed; wider: the identity may use
	// billing.worker.
	state := func() (policyLoose, wider bool) {
		err := claim("orders.inbox", 2*time.Hour)
		if status.Code(err) != codes.InvalidArgument {
			require.NoError(t, err)
			policyLoose = true
		}
		err = claim("billing.worker", 9*24*time.Hour)
		if status.Code(err) != codes.PermissionDenied {
			require.NoError(t, err)
			wider = true
		}
		return policyLoose, wider
	}
	loose, wider := state()
	require.False(t, loose)
	require.False(t, wider)

	// Valid policy, invalid access (a rate limit of zero): refused whole.
	write(loosePolicy + identity(`"orders.*", "billing.*"`) + "rate_limits:\n  - {consumers: [\"orders.*\"], rate: 0}\n")
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGHUP))
	line := p.waitLog(t, "config reload rejected; the policy and access in force stay")
	require.Contains(t, line["error"], "rate_limits[0]: rate must be a positive number")
	loose, wider = state()
	require.False(t, loose, "the policy part of a refused file must not apply")
	require.False(t, wider, "the access part of a refused file must not apply")

	// Invalid policy, valid access: refused whole too.
	write("consumers:\n  - prefix: orders.\n    message_retention: {min: 1h, default: 30m}\n" + identity(`"orders.*", "billing.*"`))
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGHUP))
	line = p.waitLog(t, "config reload rejected; the policy and access in force stay")
	require.Contains(t, line["error"], "message_retention.default 30m0s is below message_retention.min 1h0m0s")
	loose, wider = state()
	require.False(t, loose)
	require.False(t, wider)

	// Both valid: both apply.
	write(loosePolicy + identity(`"orders.*", "billing.*"`))
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGHUP))
	p.waitLog(t, "config reloaded")
	loose, wider = state()
	require.True(t, loose)
	require.True(t, wider)

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.cmd.Wait())
}
