package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/server/servertest"
)

// Issue 24, point 3: `idemreg admin resolve` with a response of a type the
// registry knows.

// resolveTarget claims key through registry and returns the resolve flags
// that name it and its token, as the operator who inspected it.
func resolveTarget(t *testing.T, addr string, registry idemregv1.RegistryServiceClient, ctx context.Context, key string) []string {
	t.Helper()
	claimed, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Fingerprint: []byte("fp")})
	require.NoError(t, err)
	return []string{"resolve", "--addr", addr, "--token", "oncall-token", "--consumer", "billing.worker", "--kind", "operation", "--key", key,
		"--expect-token", strconv.FormatInt(claimed.GetToken(), 10), "--reason", "repair, OPS-24"}
}

// replayed is the response a later Claim of key replays.
func replayed(t *testing.T, registry idemregv1.RegistryServiceClient, ctx context.Context, key string) *idemregv1.Response {
	t.Helper()
	replay, err := registry.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
	return replay.GetRecord().GetResult().GetResponse()
}

// TestAdminResolveInt64Value is the repair: JSON given as an
// Int64Value's bytes is refused before anything is stored, and the same
// value given with --response-json is stored in the wire format, which the
// next Claim replays and decodes.
func TestAdminResolveInt64Value(t *testing.T) {
	addr, registry, ctx := adminServer(t, server.Config{})
	target := resolveTarget(t, addr, registry, ctx, "charge-int")

	_, err := runAdmin(t, append(target, "--response-type", "google.protobuf.Int64Value", "--response-data", `{"value":10}`)...)
	require.ErrorContains(t, err, "do not decode as google.protobuf.Int64Value")
	require.ErrorContains(t, err, "--response-json")
	insp, err := runAdmin(t, "inspect", "--addr", addr, "--token", "oncall-token", "--consumer", "billing.worker", "--kind", "operation", "--key", "charge-int")
	require.NoError(t, err)
	require.Equal(t, "STATE_IN_PROGRESS", insp["record"].(map[string]any)["state"], "nothing was stored")

	done, err := runAdmin(t, append(target, "--response-type", "google.protobuf.Int64Value", "--response-json", `{"value":"10"}`)...)
	require.NoError(t, err)
	require.Equal(t, true, done["responseChecked"])
	resp := replayed(t, registry, ctx, "charge-int")
	require.Equal(t, "google.protobuf.Int64Value", resp.GetType())
	var got wrapperspb.Int64Value
	require.NoError(t, proto.Unmarshal(resp.GetData(), &got))
	require.EqualValues(t, 10, got.GetValue())

	// From a file, in the wrapper's own JSON form.
	file := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(file, []byte(`"7"`+"\n"), 0o600))
	_, err = runAdmin(t, append(resolveTarget(t, addr, registry, ctx, "charge-file"), "--response-type", "google.protobuf.Int64Value", "--response-json-file", file)...)
	require.NoError(t, err)
	require.NoError(t, proto.Unmarshal(replayed(t, registry, ctx, "charge-file").GetData(), &got))
	require.EqualValues(t, 7, got.GetValue())

	other := resolveTarget(t, addr, registry, ctx, "charge-other")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"JSON without a type", []string{"--response-json", `"10"`}, "--response-type"},
		{"JSON and bytes", []string{"--response-type", "google.protobuf.Int64Value", "--response-json", `"10"`, "--response-data", "x"}, "give one"},
		{"JSON not of the type", []string{"--response-type", "google.protobuf.Int64Value", "--response-json", `{"amount":10}`}, "not google.protobuf.Int64Value in the protobuf JSON mapping"},
		{"JSON of a type nobody knows", []string{"--response-type", "payments.v1.Charge", "--response-json", `{"id":"ch_1"}`}, "response_json.type"},
		{"a missing descriptor set", []string{"--response-type", "payments.v1.Charge", "--response-json", `{}`, "--descriptor-set", filepath.Join(t.TempDir(), "none.binpb")}, "--descriptor-set"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runAdmin(t, append(other, tc.args...)...)
			require.ErrorContains(t, err, tc.want)
		})
	}
	// A type the registry does not know is stored as given, and says so.
	done, err = runAdmin(t, append(other, "--response-type", "payments.v1.Charge", "--response-data", "charge-1")...)
	require.NoError(t, err)
	require.NotContains(t, done, "responseChecked", "false: stored unchecked")
}

// TestAdminResolveDescriptorSet: a type that is not linked is known to
// the CLI by its --descriptor-set (checked and encoded before the call),
// or to the server by its own (JSON sent and encoded there).
func TestAdminResolveDescriptorSet(t *testing.T) {
	set := servertest.WriteDescriptorSet(t, servertest.ChargeDescriptorSet())
	types, err := resulttype.Load(set)
	require.NoError(t, err)
	decode := func(resp *idemregv1.Response) proto.Message {
		mt, ok := types.Find(servertest.ChargeResponse)
		require.True(t, ok)
		m := mt.New().Interface()
		require.NoError(t, proto.Unmarshal(resp.GetData(), m), "the replay decodes as its type")
		return m
	}
	const charge = `{"chargeId":"ch_1","account":"acct-9","amountMinor":"1250","currency":"EUR"}`

	// The CLI knows the type, the server does not.
	addr, registry, ctx := adminServer(t, server.Config{})
	_, err = runAdmin(t, append(resolveTarget(t, addr, registry, ctx, "charge-raw"), "--response-type", servertest.ChargeResponse,
		"--response-data", "charge-1", "--descriptor-set", set)...)
	require.ErrorContains(t, err, "do not decode as payments.v1.ChargeResponse")
	done, err := runAdmin(t, append(resolveTarget(t, addr, registry, ctx, "charge-cli"), "--response-type", servertest.ChargeResponse,
		"--response-json", charge, "--descriptor-set", set)...)
	require.NoError(t, err)
	require.NotContains(t, done, "responseChecked", "encoded by the CLI; the server cannot check it")
	got := decode(replayed(t, registry, ctx, "charge-cli"))
	require.Equal(t, "ch_1", got.ProtoReflect().Get(got.ProtoReflect().Descriptor().Fields().ByName("charge_id")).String())

	// The server knows the type, the CLI does not.
	addr, registry, ctx = adminServer(t, server.Config{ResultTypes: types})
	_, err = runAdmin(t, append(resolveTarget(t, addr, registry, ctx, "charge-raw"), "--response-type", servertest.ChargeResponse,
		"--response-data", "charge-1")...)
	require.ErrorContains(t, err, "INVALID_ARGUMENT")
	require.ErrorContains(t, err, "result.response.data")
	done, err = runAdmin(t, append(resolveTarget(t, addr, registry, ctx, "charge-server"), "--response-type", servertest.ChargeResponse, "--response-json", charge)...)
	require.NoError(t, err)
	require.Equal(t, true, done["responseChecked"])
	got = decode(replayed(t, registry, ctx, "charge-server"))
	require.EqualValues(t, 1250, got.ProtoReflect().Get(got.ProtoReflect().Descriptor().Fields().ByName("amount_minor")).Int())
}

// TestServeDescriptorSet: serve reads --descriptor-set, here from
// IDEMREG_DESCRIPTOR_SET, at start and refuses to start on a file that is
// not a descriptor set.
func TestServeDescriptorSet(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "payments.proto")
	require.NoError(t, os.WriteFile(bad, []byte("syntax = \"proto3\";\n"), 0o600))
	require.ErrorContains(t, runBriefly(t, "serve", "--sweep-interval", "0", "--descriptor-set", bad), "--descriptor-set")

	t.Setenv("IDEMREG_DESCRIPTOR_SET", servertest.WriteDescriptorSet(t, servertest.ChargeDescriptorSet()))
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfgFile, []byte(`
identities:
  - {name: worker, token_hashes: ["`+access.HashToken("worker-token")+`"], consumers: ["billing.*"]}
  - {name: oncall, token_hashes: ["`+access.HashToken("oncall-token")+`"], admin: ["billing.*"]}
`), 0o600))
	listen := servetest.FreeAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--listen", listen, "--data-dir", filepath.Join(dir, "data"), "--config", cfgFile, "--sweep-interval", "0"}, io.Discard, io.Discard)
	}()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	conn, err := grpc.NewClient(listen, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	registry := idemregv1.NewRegistryServiceClient(conn)
	callCtx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer worker-token")
	var target []string
	require.Eventually(t, func() bool {
		_, err := registry.Claim(callCtx, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "probe"})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)
	target = resolveTarget(t, listen, registry, callCtx, "charge-1")
	out, err := runAdmin(t, append(target, "--response-type", servertest.ChargeResponse, "--response-json", `{"chargeId":"ch_1"}`)...)
	require.NoError(t, err)
	require.Equal(t, true, out["responseChecked"], "the server encoded the JSON with the type of its descriptor set")
}
