package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// adminServer serves an embedded store whose identities are a worker
// (billing.* through RegistryService) and an operator (billing.* through
// AdminService), and returns its address and a registry client as the
// worker.
func adminServer(t *testing.T, cfg server.Config) (string, idemregv1.RegistryServiceClient, context.Context) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
identities:
  - {name: worker, token_hashes: ["`+access.HashToken("worker-token")+`"], consumers: ["billing.*"]}
  - {name: oncall, token_hashes: ["`+access.HashToken("oncall-token")+`"], admin: ["billing.*"]}
`), 0o600))
	set, err := access.Load(path)
	require.NoError(t, err)
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	cfg.Access = set
	addr, _ := servertest.Serve(t, store, cfg)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer worker-token")
	return addr, idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr)), ctx
}

// runAdmin runs `idemreg admin args...` and decodes its JSON answer.
func runAdmin(t *testing.T, args ...string) (map[string]any, error) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), append(append([]string{"admin"}, args...), "--output", "json"), &stdout, &stderr)
	if err != nil {
		return nil, err
	}
	var out map[string]any
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &out), "JSON: %s", stdout.String())
	return out, nil
}

// TestAdminCommand runs `idemreg admin inspect` and `invalidate` against a
// real server whose identities decide who may administer what.
func TestAdminCommand(t *testing.T) {
	addr, registry, ctx := adminServer(t, server.Config{})
	claimed, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-1"})
	require.NoError(t, err)
	admin := func(args ...string) (map[string]any, error) { return runAdmin(t, args...) }
	key := []string{"--addr", addr, "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-1"}

	got, err := admin(append([]string{"inspect", "--token", "oncall-token"}, key...)...)
	require.NoError(t, err)
	rec := got["record"].(map[string]any)
	require.Equal(t, "STATE_IN_PROGRESS", rec["state"])
	require.Equal(t, strconv.FormatInt(claimed.GetToken(), 10), rec["token"])

	_, err = admin(append([]string{"inspect", "--token", "worker-token"}, key...)...)
	require.ErrorContains(t, err, "PERMISSION_DENIED", "a consumers grant is not an admin grant")
	_, err = admin(append([]string{"inspect"}, key...)...)
	require.ErrorContains(t, err, "UNAUTHENTICATED")

	_, err = admin(append([]string{"invalidate", "--token", "oncall-token"}, key...)...)
	require.ErrorContains(t, err, "--reason")
	_, err = admin(append([]string{"invalidate", "--token", "oncall-token", "--reason", "stuck after deploy", "--expect-token", "1"}, key...)...)
	require.ErrorContains(t, err, "FAILED_PRECONDITION", "a token that is not the inspected one")
	done, err := admin(append([]string{"invalidate", "--token", "oncall-token", "--reason", "stuck after deploy",
		"--expect-token", strconv.FormatInt(claimed.GetToken(), 10)}, key...)...)
	require.NoError(t, err)
	after := done["record"].(map[string]any)
	require.NotEqual(t, rec["token"], after["token"], "invalidating issues a new token")
	got, err = admin(append([]string{"inspect", "--token", "oncall-token"}, key...)...)
	require.NoError(t, err)
	history := got["history"].([]any)
	require.Len(t, history, 1, "inspect shows the attempt history")
	require.Equal(t, "ATTEMPT_END_INVALIDATED", history[0].(map[string]any)["end"])
	require.Equal(t, "stuck after deploy", history[0].(map[string]any)["note"])

	_, err = admin("inspect", "--addr", "10.0.0.1:7350", "--consumer", "c", "--kind", "message", "--key", "k")
	require.ErrorContains(t, err, "not loopback")
	_, err = admin("inspect", "--addr", addr, "--consumer", "c", "--kind", "thing", "--key", "k")
	require.ErrorContains(t, err, "--kind")
}

// TestAdminListAndResolve parks records through the registry, finds them
// with `idemreg admin list` and settles them with `idemreg admin resolve`,
// which the next Claims see.
func TestAdminListAndResolve(t *testing.T) {
	addr, registry, ctx := adminServer(t, server.Config{})
	held := map[string]*idemregv1.ClaimResponse{}
	for i := range 5 {
		key := "charge-" + strconv.Itoa(i)
		res, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Fingerprint: []byte("fp")})
		require.NoError(t, err)
		held[key] = res
		if i > 0 { // charge-0 stays in progress
			_, err = registry.Park(ctx, &idemregv1.ParkRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
				Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Reason: "sent, no answer"})
			require.NoError(t, err)
		}
	}
	_, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.other", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
	require.NoError(t, err)

	conn := []string{"--addr", addr, "--token", "oncall-token"}
	list := func(args ...string) (map[string]any, error) {
		return runAdmin(t, append(append([]string{"list"}, conn...), args...)...)
	}
	keysOf := func(out map[string]any) []string {
		var keys []string
		records, _ := out["records"].([]any)
		for _, r := range records {
			rec := r.(map[string]any)["record"].(map[string]any)
			require.NotContains(t, rec, "result", "a listing carries no result")
			keys = append(keys, rec["consumer"].(string)+"/"+rec["key"].(string))
		}
		return keys
	}

	got, err := list("--state", "parked")
	require.NoError(t, err)
	require.Equal(t, []string{"billing.worker/charge-1", "billing.worker/charge-2", "billing.worker/charge-3", "billing.worker/charge-4"}, keysOf(got),
		"without --consumer or --prefix: every consumer the identity administers")
	require.NotEmpty(t, got["storeTime"])
	got, err = list("--prefix", "billing.")
	require.NoError(t, err)
	require.Len(t, keysOf(got), 6)
	got, err = list("--consumer", "billing.other")
	require.NoError(t, err)
	require.Equal(t, []string{"billing.other/m-1"}, keysOf(got))
	got, err = list("--consumer", "billing.worker", "--state", "in_progress", "--min-attempt", "1", "--older-than", "0s")
	require.NoError(t, err)
	require.Equal(t, []string{"billing.worker/charge-0"}, keysOf(got))
	got, err = list("--consumer", "billing.worker", "--older-than", "1h")
	require.NoError(t, err)
	require.Empty(t, keysOf(got), "nothing is an hour old")

	// Paging: one page at a time with --page-token, or --all.
	page, err := list("--consumer", "billing.worker", "--page-size", "2")
	require.NoError(t, err)
	require.Equal(t, []string{"billing.worker/charge-0", "billing.worker/charge-1"}, keysOf(page))
	next, err := list("--consumer", "billing.worker", "--page-size", "2", "--page-token", page["nextPageToken"].(string))
	require.NoError(t, err)
	require.Equal(t, []string{"billing.worker/charge-2", "billing.worker/charge-3"}, keysOf(next))
	_, err = list("--consumer", "billing.worker", "--state", "parked", "--page-token", page["nextPageToken"].(string))
	require.ErrorContains(t, err, "page_token", "a token of other filters")
	every, err := list("--prefix", "billing.", "--page-size", "1", "--all")
	require.NoError(t, err)
	require.Len(t, keysOf(every), 6)
	require.NotContains(t, every, "nextPageToken")

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"consumer and prefix", []string{"--consumer", "a", "--prefix", "b"}, "--consumer or --prefix"},
		{"unknown state", []string{"--state", "stuck"}, "--state"},
		{"page too large", []string{"--page-size", "501"}, "--page-size"},
		{"not an administrator", []string{"--token", "worker-token"}, "PERMISSION_DENIED"},
		{"a stray argument", []string{"billing.worker"}, "unexpected arguments"},
	} {
		t.Run("list "+tc.name, func(t *testing.T) {
			_, err := list(tc.args...)
			require.ErrorContains(t, err, tc.want)
		})
	}

	resolve := func(key string, args ...string) (map[string]any, error) {
		return runAdmin(t, append(append([]string{"resolve"}, conn...), append([]string{"--consumer", "billing.worker", "--kind", "operation", "--key", key}, args...)...)...)
	}
	tokenOf := func(key string) string { return strconv.FormatInt(held[key].GetToken(), 10) }

	// A response, given inline: every later Claim replays it.
	done, err := resolve("charge-1", "--expect-token", tokenOf("charge-1"), "--reason", "provider charged once, OPS-1",
		"--response-type", "payments.v1.Charge", "--response-data", "ch_123")
	require.NoError(t, err)
	require.Equal(t, "STATE_COMPLETED", done["record"].(map[string]any)["state"])
	replay, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-1", Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	require.Equal(t, "payments.v1.Charge", replay.GetRecord().GetResult().GetResponse().GetType())
	require.Equal(t, "ch_123", string(replay.GetRecord().GetResult().GetResponse().GetData()))
	_, err = resolve("charge-1", "--expect-token", tokenOf("charge-1"), "--reason", "again", "--release")
	require.ErrorContains(t, err, "FAILED_PRECONDITION", "of two operators with one token, the second")

	// A response from a file.
	file := filepath.Join(t.TempDir(), "response.bin")
	require.NoError(t, os.WriteFile(file, []byte{0, 1, 2, 0xff}, 0o600))
	_, err = resolve("charge-2", "--expect-token", tokenOf("charge-2"), "--reason", "from the provider's export", "--response-type", "payments.v1.Charge", "--response-file", file)
	require.NoError(t, err)
	replay, err = registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-2", Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.Equal(t, []byte{0, 1, 2, 0xff}, replay.GetRecord().GetResult().GetResponse().GetData())

	// A failure, its code by name.
	_, err = resolve("charge-3", "--expect-token", tokenOf("charge-3"), "--reason", "card declined per provider", "--failure-code", "failed_precondition", "--failure-message", "declined")
	require.NoError(t, err)
	replay, err = registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-3", Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.EqualValues(t, codes.FailedPrecondition, replay.GetRecord().GetResult().GetFailure().GetCode())
	require.Equal(t, "declined", replay.GetRecord().GetResult().GetFailure().GetMessage())

	// Released: the next Claim acquires as attempt 1.
	rel, err := resolve("charge-4", "--expect-token", tokenOf("charge-4"), "--reason", "not charged, retry", "--release")
	require.NoError(t, err)
	require.Equal(t, "STATE_IN_PROGRESS", rel["record"].(map[string]any)["state"])
	again, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge-4", Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, again.GetOutcome())
	require.EqualValues(t, 1, again.GetRecord().GetAttempt())

	insp, err := runAdmin(t, append(append([]string{"inspect"}, conn...), "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-4")...)
	require.NoError(t, err)
	last := insp["history"].([]any)[0].(map[string]any)
	require.Equal(t, "ATTEMPT_END_RESOLVED_RELEASED", last["end"])
	require.Equal(t, "not charged, retry", last["note"])
	require.Equal(t, "sent, no answer", last["parkReason"])

	token0 := tokenOf("charge-0")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no reason", []string{"--expect-token", token0, "--release"}, "--reason"},
		{"no token", []string{"--reason", "r", "--release"}, "--expect-token"},
		{"no resolution", []string{"--expect-token", token0, "--reason", "r"}, "--release, a response"},
		{"release and a result", []string{"--expect-token", token0, "--reason", "r", "--release", "--response-type", "t"}, "exactly one"},
		{"a response and a failure", []string{"--expect-token", token0, "--reason", "r", "--response-data", "d", "--failure-code", "9"}, "exactly one"},
		{"data and a file", []string{"--expect-token", token0, "--reason", "r", "--response-data", "d", "--response-file", file}, "give one"},
		{"an unknown code", []string{"--expect-token", token0, "--reason", "r", "--failure-code", "OOPS"}, "--failure-code"},
		{"a code out of range", []string{"--expect-token", token0, "--reason", "r", "--failure-code", "0"}, "INVALID_ARGUMENT"},
		{"a missing file", []string{"--expect-token", token0, "--reason", "r", "--response-file", filepath.Join(t.TempDir(), "none")}, "no such file"},
	} {
		t.Run("resolve "+tc.name, func(t *testing.T) {
			_, err := resolve("charge-0", tc.args...)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err = runAdmin(t, append(append([]string{"resolve"}, conn...), "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-0",
		"--token", "worker-token", "--expect-token", token0, "--reason", "r", "--release")...)
	require.ErrorContains(t, err, "PERMISSION_DENIED")
}

// TestAdminHelp: `idemreg admin help` lists every command, and each
// command's -h its flags.
func TestAdminHelp(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"admin", "help"}, &stdout, &stderr))
	for _, cmd := range []string{"admin list", "admin inspect", "admin resolve", "admin invalidate", "--release", "--page-token", "--all"} {
		require.Contains(t, stdout.String(), cmd)
	}
	for cmd, flags := range map[string][]string{
		"list":       {"-consumer", "-prefix", "-state", "-min-attempt", "-older-than", "-page-size", "-page-token", "-all", "-tls-ca"},
		"inspect":    {"-consumer", "-kind", "-key", "-token"},
		"resolve":    {"-expect-token", "-reason", "-release", "-response-type", "-response-data", "-response-file", "-response-json", "-response-json-file", "-descriptor-set", "-failure-code", "-failure-message"},
		"invalidate": {"-expect-token", "-reason"},
	} {
		t.Run(cmd, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(t.Context(), []string{"admin", cmd, "-h"}, &stdout, &stderr)
			require.True(t, errors.Is(err, flag.ErrHelp), "%v", err)
			require.Contains(t, stderr.String(), "usage: idemreg admin "+cmd)
			for _, f := range flags {
				require.Contains(t, stderr.String(), f)
			}
		})
	}
	err := run(t.Context(), []string{"admin", "frobnicate"}, &stdout, &stderr)
	require.ErrorContains(t, err, `unknown admin command "frobnicate"`)
}

// TestParkedGaugeOnMetrics: the parked records gauge reaches /metrics as
// idemreg_parked_records{consumer}, fed by the server's own count.
func TestParkedGaugeOnMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	require.NoError(t, err)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	_, registry, ctx := adminServer(t, server.Config{MeterProvider: mp, ParkedCountInterval: 10 * time.Millisecond})
	for _, key := range []string{"m-1", "m-2"} {
		res, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key})
		require.NoError(t, err)
		_, err = registry.Park(ctx, &idemregv1.ParkRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
			Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Reason: "poison"})
		require.NoError(t, err)
	}
	parked := func() float64 {
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			if f.GetName() != "idemreg_parked_records" {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "consumer" && l.GetValue() == "billing.worker" {
						return m.GetGauge().GetValue()
					}
				}
			}
		}
		return -1
	}
	require.Eventually(t, func() bool { return parked() == 2 }, 10*time.Second, 10*time.Millisecond)
}
