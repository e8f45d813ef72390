package admincli_test

import (
	"bytes"
	"flag"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/admincli"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// run runs an admin command against addr, as the binary does, and
// returns what it printed.
func run(t *testing.T, addr, name string, args ...string) string {
	t.Helper()
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	call := admincli.Commands[name].Bind(fs)
	require.NoError(t, fs.Parse(append([]string{"--addr", addr}, args...)))
	var out bytes.Buffer
	require.NoError(t, call(t.Context(), &out))
	return out.String()
}

// TestInspectTableShowsHistory: `idemreg admin inspect` in table form
// prints the attempt history `admin help` promises, against a real
// server: a record parked by its first holder, released by an operator
// (resolve --release) and claimed again, then invalidated, shows both
// earlier attempts, oldest first, with their holders, tokens, how each
// ended, the park reason and the operators' notes; JSON carries the same.
func TestInspectTableShowsHistory(t *testing.T) {
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(t, store, server.Config{})
	api := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr))
	key := []string{"--consumer", "billing.payments", "--kind", "message", "--key", "msg-9c04"}
	claim := func(holder string) *idemregv1.ClaimResponse {
		res, err := api.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: "billing.payments", Kind: idemregv1.Kind_KIND_MESSAGE,
			Key: "msg-9c04", Holder: holder, Lease: durationpb.New(60e9)})
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
		return res
	}

	first := claim("worker-1")
	_, err = api.Park(t.Context(), &idemregv1.ParkRequest{Consumer: "billing.payments", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "msg-9c04",
		Token: first.GetToken(), ClaimSecret: first.GetClaimSecret(), Reason: "card declined 3 times"})
	require.NoError(t, err)
	out := run(t, addr, "inspect", append(key, "--output", "table")...)
	require.Contains(t, out, "history: none", out)

	run(t, addr, "resolve", append(key, "--expect-token", strconv.FormatInt(first.GetToken(), 10), "--reason", "card replaced", "--release")...)
	second := claim("worker-2")
	run(t, addr, "invalidate", append(key, "--expect-token", strconv.FormatInt(second.GetToken(), 10), "--reason", "stuck after deploy")...)

	out = run(t, addr, "inspect", key...)
	t.Logf("admin inspect:\n%s", out)
	_, table, ok := strings.Cut(out, "history: 2 earlier attempts\n")
	require.True(t, ok, "a history table after the record's rows: %s", out)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	require.Len(t, lines, 3, "a header and two attempts: %s", table)
	require.Equal(t, []string{"ATTEMPT", "TOKEN", "HOLDER", "ACQUIRED", "ENDED", "END", "NOTE"}, strings.Fields(lines[0]))
	for i, want := range []struct{ token, holder, end, note string }{
		{strconv.FormatInt(first.GetToken(), 10), "worker-1", "resolved: released", "parked: card declined 3 times; card replaced"},
		{strconv.FormatInt(second.GetToken(), 10), "worker-2", "invalidated", "stuck after deploy"},
	} {
		row := lines[1+i]
		require.Equal(t, "1", strings.Fields(row)[0], "attempt 1 both times: a release starts afresh: %s", row)
		require.Equal(t, want.token, strings.Fields(row)[1], row)
		require.Equal(t, want.holder, strings.Fields(row)[2], row)
		require.Contains(t, row, "ago", "acquired and ended relative to the store's clock: %s", row)
		require.Contains(t, row, want.end, row)
		require.True(t, strings.HasSuffix(row, want.note), "%q ends with the note %q", row, want.note)
	}

	js := run(t, addr, "inspect", append(key, "--output", "json")...)
	require.Contains(t, js, `"history":[`, js)
	require.Contains(t, js, "ATTEMPT_END_RESOLVED_RELEASED", js)
	require.Contains(t, js, "ATTEMPT_END_INVALIDATED", js)
}
