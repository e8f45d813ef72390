package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// TestAdminOutput runs the admin CLI against a real server: tables by
// default (aligned columns, states in words, times to the second), stable
// one-line JSON with --output json, and refusals as "error: ..." with the
// code, reason and field violations.
func TestAdminOutput(t *testing.T) {
	addr, registry, ctx := adminServer(t, server.Config{})
	for _, key := range []string{"charge-1", "charge-2"} {
		_, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
		require.NoError(t, err)
	}
	claimed, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "parked-1"})
	require.NoError(t, err)
	_, err = registry.Park(ctx, &idemregv1.ParkRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "parked-1",
		Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret(), Reason: "poison message"})
	require.NoError(t, err)
	conn := []string{"--addr", addr, "--token", "oncall-token"}
	admin := func(args ...string) (string, error) {
		var stdout bytes.Buffer
		err := run(t.Context(), append(append([]string{"admin"}, args...), conn...), &stdout, &bytes.Buffer{})
		return stdout.String(), err
	}

	// A table: a header, a row a record, columns aligned.
	out, err := admin("list", "--prefix", "billing.")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, 5, out)
	require.Regexp(t, `^CONSUMER +KIND +KEY +STATE +ATTEMPT +TOKEN +HOLDER +CREATED +EXPIRES$`, lines[0])
	state := strings.Index(lines[0], "STATE")
	for _, l := range lines[1:4] {
		require.Regexp(t, `^(in progress|parked) `, l[state:], "the STATE column is aligned:\n%s", out)
		require.Regexp(t, `  \d+s ago +in \d+[dh]\S*$`, l, "times relative to the store's clock")
	}
	require.Contains(t, out, "parked")
	require.Equal(t, "3 records", lines[4])
	require.NotContains(t, out, "STATE_", "states in words")

	out, err = admin("inspect", "--consumer", "billing.worker", "--kind", "message", "--key", "parked-1")
	require.NoError(t, err)
	require.Regexp(t, `(?m)^state: +parked$`, out)
	require.Regexp(t, `(?m)^park reason: +poison message$`, out)
	require.Regexp(t, `(?m)^created: +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(\d+s ago\)$`, out)

	// JSON: one line an answer, the same bytes every time.
	first, err := admin("list", "--prefix", "billing.", "--output", "json")
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(first, "\n"), first)
	var got map[string]any
	require.NoError(t, json.Unmarshal([]byte(first), &got))
	require.Len(t, got["records"], 3)
	var compact bytes.Buffer
	require.NoError(t, json.Compact(&compact, []byte(first)))
	require.Equal(t, compact.String()+"\n", first, "no spacing of protojson's")
	clock := regexp.MustCompile(`"storeTime":"[^"]+"`) // the one field that moves
	for range 3 {
		again, err := admin("list", "--prefix", "billing.", "--output", "json")
		require.NoError(t, err)
		require.Equal(t, clock.ReplaceAllString(first, ""), clock.ReplaceAllString(again, ""))
	}
	_, err = admin("list", "--output", "yaml")
	require.ErrorContains(t, err, "--output must be table or json")

	// Refusals: the message, code, reason and metadata, then the field
	// violations; never gRPC's "rpc error: code = ... desc = ...".
	_, err = admin("invalidate", "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-1", "--reason", "r", "--expect-token", "1")
	require.Regexp(t, `^error: .+ \(FAILED_PRECONDITION, reason LEASE_LOST(, [a-z_]+=\S+)*\)$`, err.Error())
	_, err = admin("inspect", "--consumer", "billing.a b", "--kind", "operation", "--key", "")
	require.Regexp(t, `^error: invalid request: consumer: .+ \(INVALID_ARGUMENT, reason [A-Z_]+.*\)\n  field key: required$`, err.Error(),
		"the first violation is the message; the others follow, one a line")
	require.NotContains(t, err.Error(), "rpc error")

	// The binary prints it so, and exits 1.
	cmd := exec.CommandContext(t.Context(), servetest.Binary(t), append([]string{"admin", "inspect", "--consumer", "billing.worker",
		"--kind", "operation", "--key", "charge-9"}, conn...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	var exit *exec.ExitError
	require.True(t, errors.As(cmd.Run(), &exit))
	require.Equal(t, 1, exit.ExitCode())
	require.Regexp(t, regexp.MustCompile(`^error: .+ \(NOT_FOUND, reason [A-Z_]+.*\)\n$`), stderr.String())
}
