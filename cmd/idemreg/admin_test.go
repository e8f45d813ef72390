package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// TestAdminCommand runs `idemreg admin inspect` and `invalidate` against a
// real server whose identities decide who may administer what.
func TestAdminCommand(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
identities:
  - {name: worker, token_hashes: ["`+access.HashToken("worker-token")+`"], consumers: ["billing.*"]}
  - {name: oncall, token_hashes: ["`+access.HashToken("oncall-token")+`"], admin: ["billing.*"]}
`), 0o600))
	src, err := access.OpenFile(path)
	require.NoError(t, err)
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(t, store, server.Config{Access: src})

	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer worker-token")
	claimed, err := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr)).Claim(ctx,
		&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-1"})
	require.NoError(t, err)

	admin := func(args ...string) (map[string]any, error) {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), append([]string{"admin"}, args...), &stdout, &stderr)
		if err != nil {
			return nil, err
		}
		var out map[string]any
		require.NoError(t, json.Unmarshal(stdout.Bytes(), &out), "JSON: %s", stdout.String())
		return out, nil
	}
	key := []string{"--addr", addr, "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-1"}

	got, err := admin(append([]string{"inspect", "--token", "oncall-token"}, key...)...)
	require.NoError(t, err)
	rec := got["record"].(map[string]any)
	require.Equal(t, "STATE_IN_PROGRESS", rec["state"])
	require.Equal(t, strconv.FormatInt(claimed.GetToken(), 10), rec["token"])

	_, err = admin(append([]string{"inspect", "--token", "worker-token"}, key...)...)
	require.ErrorContains(t, err, "PermissionDenied", "a consumers grant is not an admin grant")
	_, err = admin(append([]string{"inspect"}, key...)...)
	require.ErrorContains(t, err, "Unauthenticated")

	_, err = admin(append([]string{"invalidate", "--token", "oncall-token"}, key...)...)
	require.ErrorContains(t, err, "--reason")
	_, err = admin(append([]string{"invalidate", "--token", "oncall-token", "--reason", "stuck after deploy", "--expect-token", "1"}, key...)...)
	require.ErrorContains(t, err, "FailedPrecondition", "a token that is not the inspected one")
	done, err := admin(append([]string{"invalidate", "--token", "oncall-token", "--reason", "stuck after deploy",
		"--expect-token", strconv.FormatInt(claimed.GetToken(), 10)}, key...)...)
	require.NoError(t, err)
	after := done["record"].(map[string]any)
	require.NotEqual(t, rec["token"], after["token"], "invalidating issues a new token")

	_, err = admin("inspect", "--addr", "10.0.0.1:7350", "--consumer", "c", "--kind", "message", "--key", "k")
	require.ErrorContains(t, err, "not loopback")
	_, err = admin("inspect", "--addr", addr, "--consumer", "c", "--kind", "thing", "--key", "k")
	require.ErrorContains(t, err, "--kind")
}
