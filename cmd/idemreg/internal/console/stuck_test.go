package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

var stuckPreset = regexp.MustCompile(`<a href="([^"]*)" id="preset-stuck">`)

// TestConsoleStuckPreset: the "stuck" preset lists the records in progress
// that someone holds, first claimed over Config.StuckAfter ago; a record
// an operator invalidated or released (in progress, nobody holding it,
// attempt 0 or not) is left out until a Claim acquires it again, and is
// shown in words wherever it is listed.
func TestConsoleStuckPreset(t *testing.T) {
	e := setup(t, true, func(c *console.Config) { c.StuckAfter = time.Nanosecond })
	admin := idemregv1.NewAdminServiceClient(e.conn)
	e.claim(t, "charge:held", "w-held")
	held := e.claim(t, "charge:invalidated", "w-inv")
	_, err := admin.InvalidateRecord(oncall(t), &idemregv1.InvalidateRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:invalidated", Token: held.GetToken(), Reason: "stuck test"})
	require.NoError(t, err)
	parked := e.park(t, consumer, "charge:parked-invalidated", "w-park", "timeout after send")
	_, err = admin.InvalidateRecord(oncall(t), &idemregv1.InvalidateRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:parked-invalidated", Token: e.inspect(t, "charge:parked-invalidated").GetToken(), Reason: "stuck test"})
	require.NoError(t, err)
	_ = parked
	released := e.claim(t, "charge:released", "w-rel")
	_, err = admin.ResolveRecord(oncall(t), &idemregv1.ResolveRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:released", Token: released.GetToken(), Reason: "stuck test",
		Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
	require.NoError(t, err)
	c := e.signIn(t, oncallToken)

	_, body := get(t, c, e.console.URL+"/records")
	m := stuckPreset.FindStringSubmatch(body)
	require.NotNil(t, m, body)
	stuck := e.console.URL + htmlUnescape(m[1])
	code, body := get(t, c, stuck)
	require.Equal(t, http.StatusOK, code, body)
	keys, _ := listed(body)
	require.Equal(t, []string{"charge:held"}, keys, "only the held record is stuck")
	require.Contains(t, body, `id="unheld">1 record of this page left out`, "the invalidated one, still at attempt 1; the others are filtered by attempt")
	require.NotContains(t, body, ">STATE_", "no enum name shown as text")

	// Every record in progress, in words.
	code, body = get(t, c, e.console.URL+"/records?"+url.Values{"state": {"STATE_IN_PROGRESS"}}.Encode())
	require.Equal(t, http.StatusOK, code, body)
	keys, _ = listed(body)
	require.ElementsMatch(t, []string{"charge:held", "charge:invalidated", "charge:parked-invalidated", "charge:released"}, keys)
	require.Contains(t, body, `<td class="state" data-label="State">invalidated, awaiting the next claim</td>`)
	require.Contains(t, body, `<td class="state" data-label="State">released, awaiting the next claim</td>`)
	require.Contains(t, body, `<td class="state" data-label="State">in progress</td>`)
	require.NotContains(t, body, "STATE_IN_PROGRESS<")

	// Claimed again, the invalidated record is held, and stuck once more.
	e.claim(t, "charge:invalidated", "w-again")
	_, body = get(t, c, stuck)
	keys, _ = listed(body)
	require.ElementsMatch(t, []string{"charge:held", "charge:invalidated"}, keys)
}
