package console_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// chromium is Debian's package's binary; .ci/run installs it.
const chromium = "/usr/bin/chromium"

// browserDir holds the Playwright script and its pinned playwright-core
// (npm ci there; .ci/run does it).
const browserDir = "testdata/browser"

// artifactDir is where the browser test keeps its screenshot:
// $IDEMREG_TEST_ARTIFACTS, or idemreg-test-artifacts in the temporary
// directory, which outlives the test.
func artifactDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("IDEMREG_TEST_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "idemreg-test-artifacts")
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	return dir
}

// needBrowser skips the test where Chromium, node or playwright-core is
// missing, except in CI (CI set), where it fails.
func needBrowser(t *testing.T) {
	t.Helper()
	var missing string
	if _, err := os.Stat(chromium); err != nil {
		missing = chromium + " (apt-get install chromium)"
	} else if _, err := exec.LookPath("node"); err != nil {
		missing = "node"
	} else if _, err := os.Stat(filepath.Join(browserDir, "node_modules", "playwright-core")); err != nil {
		missing = filepath.Join("cmd/idemreg/internal/console", browserDir, "node_modules/playwright-core") + " (npm ci in " + filepath.Join("cmd/idemreg/internal/console", browserDir) + ")"
	}
	if missing != "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("browser test cannot run in CI: %s is missing; .ci/run should have installed it", missing)
		}
		t.Skipf("SKIPPED: the browser test needs %s", missing)
	}
}

// runBrowser runs the Playwright script in browserDir with env (and
// CHROMIUM, USER_DATA_DIR) and decodes the JSON line it prints into seen.
func runBrowser(t *testing.T, script string, seen any, env ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", script)
	cmd.Dir = browserDir
	cmd.Env = append(append(os.Environ(), "CHROMIUM="+chromium, "USER_DATA_DIR="+t.TempDir()), env...)
	out, err := cmd.Output()
	var stderr []byte
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = ee.Stderr
	}
	require.NoError(t, err, "node %s: %s%s", script, out, stderr)
	require.NoError(t, json.Unmarshal(out, seen), "%s", out)
}

// screenshot is the path of a fresh screenshot named name in the
// artifact directory.
func screenshot(t *testing.T, name string) string {
	t.Helper()
	path := filepath.Join(artifactDir(t), name)
	_ = os.Remove(path)
	return path
}

// TestConsoleInBrowser clicks through the console in headless Chromium,
// driven by Playwright, against a real server: sign in, look up a claimed
// key whose name is markup, invalidate it with a reason through the
// confirmation, and see its new state. Without Chromium, node or
// node_modules it skips, except in CI (CI set), where it fails.
func TestConsoleInBrowser(t *testing.T) {
	needBrowser(t)

	e := setup(t, true)
	const key = `charge:<img src=x onerror=alert("xss")>`
	claimed := e.claim(t, key, "worker-<b>7</b>")
	shot := screenshot(t, "console-invalidated.png")
	const reason = "worker-7 crashed with a long lease, OPS-7"

	var seen struct {
		Identity, StoreHealth, KeyShown, HolderShown string
		StateBefore, TokenBefore, ConfirmReason      string
		Notice, StateAfter, TokenAfter               string
		Dialogs                                      []struct{ Type, Message string }
		ConsoleErrors                                []string
	}
	runBrowser(t, "console.mjs", &seen,
		"CONSOLE_URL="+e.console.URL, "TOKEN="+oncallToken, "CONSUMER="+consumer, "KEY="+key, "REASON="+reason, "SCREENSHOT="+shot)
	t.Logf("screenshot: %s", shot)
	require.FileExists(t, shot)

	require.Equal(t, "oncall", seen.Identity)
	require.Equal(t, "SERVING", seen.StoreHealth)
	require.Equal(t, key, seen.KeyShown, "the key is shown as text")
	require.Equal(t, "worker-<b>7</b>", seen.HolderShown)
	require.Equal(t, "in progress", seen.StateBefore)
	require.Equal(t, strconv.FormatInt(claimed.GetToken(), 10), seen.TokenBefore)
	require.Equal(t, reason, seen.ConfirmReason)
	require.Len(t, seen.Dialogs, 1, "only the confirmation, no alert from the key: %v", seen.Dialogs)
	require.Equal(t, "confirm", seen.Dialogs[0].Type)
	require.Contains(t, seen.Notice, "Invalidated")

	rec := e.inspect(t, key)
	require.Greater(t, rec.GetToken(), claimed.GetToken())
	require.Equal(t, strconv.FormatInt(rec.GetToken(), 10), seen.TokenAfter, "the page shows the record after the invalidation")
	require.Equal(t, "invalidated, awaiting the next claim", seen.StateAfter, "readable: not STATE_IN_PROGRESS")
	var audited bool
	for _, l := range e.logs.lines(t, "admin action") {
		audited = audited || (l["action"] == "invalidate" && l["reason"] == reason && l["identity"] == "oncall")
	}
	require.True(t, audited, "the invalidation is in the audit log")
	require.Empty(t, seen.ConsoleErrors, "no script or policy error in the page")
}

// TestConsoleResolveInBrowser resolves a parked record in headless
// Chromium against a real server: sign in, open the records page, find the
// parked record (a key and a park reason that are markup), open it, read
// its attempt history, complete it with a result through the
// confirmation, and then a Claim through the registry replays that result.
// It keeps screenshots of the records page, the confirmation and the
// resolved record.
func TestConsoleResolveInBrowser(t *testing.T) {
	needBrowser(t)

	e := setup(t, true)
	const (
		key        = `refund:<img src=x onerror=alert("xss")>`
		parkReason = `provider timed out after the send; outcome <i>unknown</i>`
		reason     = "provider shows refund rf_9 succeeded, OPS-9"
		resultType = "example.v1.RefundResponse"
		resultData = `{"refund":"rf_9","status":"succeeded"}`
	)
	// Attempt 1 released, attempt 2 parked with a reason: two lines of
	// history by the time the operator is done.
	retried := e.retried(t, key, "worker-<b>8</b>", "worker-<b>9</b>")
	_, err := e.registry().Park(oncall(t), &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Token: retried.GetToken(), ClaimSecret: retried.GetClaimSecret(), Reason: parkReason})
	require.NoError(t, err)
	parked := e.claim(t, key, "worker-10")
	require.Equal(t, idemregv1.Outcome_OUTCOME_PARKED, parked.GetOutcome(), "parked until an operator resolves it")
	e.park(t, consumer, "charge:other", "worker-11", "another parked record on the page")

	recordsShot, confirmShot, resolvedShot := screenshot(t, "console-records.png"), screenshot(t, "console-resolve-confirm.png"), screenshot(t, "console-resolved.png")
	var seen struct {
		Identity, Parked, SweepLag                              string
		RowsMatching                                            int
		Row                                                     map[string]string
		State, KeyShown, ParkReason                             string
		History, HistoryAfter                                   []map[string]string
		ResultFieldsHiddenAtFirst, ResultFieldsShownForComplete bool
		ConfirmReason, ConfirmAction, ConfirmType               string
		ConfirmPreview                                          string
		Notice, StateAfter, ResultType, ResultPreview           string
		ResolveFormAfter, ReleaseAfter                          int
		Dialogs                                                 []struct{ Type, Message string }
		ConsoleErrors                                           []string
	}
	runBrowser(t, "resolve.mjs", &seen,
		"CONSOLE_URL="+e.console.URL, "TOKEN="+oncallToken, "KEY="+key, "REASON="+reason,
		"RESULT_TYPE="+resultType, "RESULT_DATA="+resultData,
		"RECORDS_SCREENSHOT="+recordsShot, "CONFIRM_SCREENSHOT="+confirmShot, "RESOLVED_SCREENSHOT="+resolvedShot)
	for _, shot := range []string{recordsShot, confirmShot, resolvedShot} {
		t.Logf("screenshot: %s", shot)
		require.FileExists(t, shot)
	}

	require.Equal(t, "oncall", seen.Identity)
	require.Contains(t, seen.Parked, "2 in all")
	require.Equal(t, "none: no stored record has expired yet", seen.SweepLag)
	require.Equal(t, 1, seen.RowsMatching)
	require.Equal(t, map[string]string{"consumer": consumer, "key": key, "state": "parked", "attempt": "2",
		"holder": "worker-<b>9</b>", "park-reason": parkReason}, seen.Row, "the row shows the record, as text")
	require.Equal(t, "parked", seen.State)
	require.Equal(t, key, seen.KeyShown)
	require.Equal(t, parkReason, seen.ParkReason)
	require.Equal(t, []map[string]string{{"attempt": "1", "holder": "worker-<b>8</b>", "end": "taken over (its lease ended)"}}, seen.History)

	require.True(t, seen.ResultFieldsHiddenAtFirst, "release is the default: no result fields")
	require.True(t, seen.ResultFieldsShownForComplete)
	require.Equal(t, reason, seen.ConfirmReason)
	require.Contains(t, seen.ConfirmAction, "every later Claim of the key replays this result")
	require.Equal(t, resultType, seen.ConfirmType)
	require.Equal(t, hex.EncodeToString([]byte(resultData)), seen.ConfirmPreview)
	require.Len(t, seen.Dialogs, 1, "only the confirmation, no alert from the key: %v", seen.Dialogs)
	require.Equal(t, "confirm", seen.Dialogs[0].Type)

	require.Contains(t, seen.Notice, "Resolved with your result")
	require.Equal(t, "completed", seen.StateAfter)
	require.Equal(t, resultType, seen.ResultType)
	require.Equal(t, hex.EncodeToString([]byte(resultData)), seen.ResultPreview)
	require.Equal(t, []map[string]string{
		{"attempt": "1", "end": "taken over (its lease ended)", "note": ""},
		{"attempt": "2", "end": "resolved by an operator: completed", "note": reason},
	}, seen.HistoryAfter)
	require.Equal(t, 1, seen.ResolveFormAfter, "a completed record offers the repair of its result")
	require.Zero(t, seen.ReleaseAfter, "and no release")
	require.Empty(t, seen.ConsoleErrors, "no script or policy error in the page")

	// The registry replays the operator's result.
	again := e.claim(t, key, "worker-12")
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, again.GetOutcome())
	resp := again.GetRecord().GetResult().GetResponse()
	require.Equal(t, resultType, resp.GetType())
	require.Equal(t, []byte(resultData), resp.GetData())
	var audited bool
	for _, l := range e.logs.lines(t, "admin action") {
		audited = audited || (l["action"] == "resolve" && l["reason"] == reason && l["identity"] == "oncall" && l["result"] == "ok")
	}
	require.True(t, audited, "the resolution is in the audit log")
}

// TestConsoleBulkInBrowser invalidates two of three parked records at
// once in headless Chromium: select every record of the page (the
// select-all box), leave one out, give a reason, review, confirm once.
// Each record is a call of its own: one audit event each.
func TestConsoleBulkInBrowser(t *testing.T) {
	needBrowser(t)

	e := setup(t, true)
	keys := []string{"charge:bulk-1", "charge:bulk-2", "charge:bulk-3"}
	for _, k := range keys {
		e.park(t, consumer, k, "worker", "provider timed out after the send")
	}
	const reason = "provider incident OPS-88: retry all"
	confirmShot, doneShot := screenshot(t, "console-bulk-confirm.png"), screenshot(t, "console-bulk-done.png")
	var seen struct {
		SelectAllVisible                    bool
		CheckedAfterSelectAll, Checked      int
		ConfirmTitle, ConfirmReason, Notice string
		ConfirmKeys                         []string
		Results                             []map[string]string
		StatesAfter                         map[string]string
		Dialogs                             []struct{ Type, Message string }
		ConsoleErrors                       []string
	}
	runBrowser(t, "bulk.mjs", &seen, "CONSOLE_URL="+e.console.URL, "TOKEN="+oncallToken, "SPARED_KEY=charge:bulk-2", "REASON="+reason,
		"CONFIRM_SCREENSHOT="+confirmShot, "DONE_SCREENSHOT="+doneShot)
	for _, shot := range []string{confirmShot, doneShot} {
		t.Logf("screenshot: %s", shot)
		require.FileExists(t, shot)
	}

	require.True(t, seen.SelectAllVisible, "the select-all box shows with script")
	require.Equal(t, 3, seen.CheckedAfterSelectAll)
	require.Equal(t, 2, seen.Checked)
	require.Equal(t, "Confirm: Invalidate 2 records", seen.ConfirmTitle)
	require.Equal(t, reason, seen.ConfirmReason)
	require.Equal(t, []string{"charge:bulk-1", "charge:bulk-3"}, seen.ConfirmKeys)
	require.Equal(t, "Invalidate: 2 of 2 records done.", seen.Notice)
	require.Equal(t, []map[string]string{{"key": "charge:bulk-1", "outcome": "done"}, {"key": "charge:bulk-3", "outcome": "done"}}, seen.Results)
	require.Equal(t, map[string]string{"charge:bulk-2": "parked"}, seen.StatesAfter, "back on the parked list: only the one left out")
	require.Empty(t, seen.Dialogs, "one confirmation, the page's")
	require.Empty(t, seen.ConsoleErrors)

	var audited []string
	for _, l := range e.logs.lines(t, "admin action") {
		if l["action"] == "invalidate" && l["reason"] == reason && l["identity"] == "oncall" && l["result"] == "ok" {
			audited = append(audited, l["key"].(string))
		}
	}
	require.ElementsMatch(t, []string{"charge:bulk-1", "charge:bulk-3"}, audited, "one audit event per record")
	require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:bulk-2").GetState())
}

// TestConsoleNarrowInBrowser reads the console at 400 px wide, in
// Tokyo's time zone, signed in by a trusted proxy's header
// (X-Forwarded-Email, as oauth2-proxy sets it) with its secret: no page is wider than the
// viewport, states are words and times are the browser's local time to
// the second, relative, with the exact UTC instant in their title.
func TestConsoleNarrowInBrowser(t *testing.T) {
	needBrowser(t)

	e := setup(t, true, withProxy())
	key := "refund:" + strings.Repeat("0123456789abcdef", 12) // a long key with no place to break
	retried := e.retried(t, key, "worker-"+strings.Repeat("x", 60), "worker-2")
	_, err := e.registry().Park(oncall(t), &idemregv1.ParkRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Token: retried.GetToken(), ClaimSecret: retried.GetClaimSecret(), Reason: "provider timed out after the send; " + strings.Repeat("detail ", 20)})
	require.NoError(t, err)
	e.park(t, consumer, "charge:other", "worker-3", "another")
	created := e.inspect(t, key).GetCreatedAt().AsTime()

	var seen struct {
		Pages map[string]struct {
			ScrollWidth, BodyScrollWidth, InnerWidth int
			Wide                                     []string
		}
		Identity, RowState, RowTime, RowRel string
		RowTimeTitle, State, Created        string
		CreatedTitle                        string
		RowStateVisible                     bool
		Dialogs                             []struct{ Type, Message string }
		ConsoleErrors                       []string
	}
	dir := artifactDir(t)
	runBrowser(t, "narrow.mjs", &seen, "CONSOLE_URL="+e.console.URL, "PROXY_HEADER="+proxyHeader, "PROXY_USER=alice@example.com",
		"PROXY_SECRET_HEADER="+console.ProxySecretHeader, "PROXY_SECRET="+proxySecret,
		"KEY="+key, "SCREENSHOT_DIR="+dir)
	t.Logf("screenshots: %s/console-400px-*.png", dir)

	require.Equal(t, "oncall", seen.Identity, "signed in by the proxy's header")
	require.Len(t, seen.Pages, 3)
	for name, p := range seen.Pages {
		t.Logf("%s at 400 px: document.scrollWidth %d, body.scrollWidth %d", name, p.ScrollWidth, p.BodyScrollWidth)
		require.Equal(t, 400, p.InnerWidth, name)
		require.LessOrEqual(t, p.ScrollWidth, 400, "%s overflows at 400 px: %v", name, p.Wide)
		require.LessOrEqual(t, p.BodyScrollWidth, 400, "%s overflows at 400 px: %v", name, p.Wide)
	}
	tokyo := time.FixedZone("JST", 9*3600)
	require.Equal(t, "parked", seen.RowState)
	require.True(t, seen.RowStateVisible)
	require.True(t, strings.HasPrefix(seen.RowTime, created.In(tokyo).Format("2006-01-02 15:04:05")), "local time to the second: %q", seen.RowTime)
	require.Equal(t, created.UTC().Format(time.RFC3339Nano), seen.RowTimeTitle, "the exact UTC instant in the title")
	require.Regexp(t, `^\((now|\d+s ago|in \d+s)\)$`, seen.RowRel)
	require.Equal(t, "parked", seen.State)
	require.True(t, strings.HasPrefix(seen.Created, created.In(tokyo).Format("2006-01-02 15:04:05")), "%q", seen.Created)
	require.Equal(t, created.UTC().Format(time.RFC3339Nano), seen.CreatedTitle)
	require.Empty(t, seen.Dialogs)
	require.Empty(t, seen.ConsoleErrors)
}

// TestConsoleCrossOriginInBrowser submits the console's sign-in form from
// a page of another origin in headless Chromium: the console refuses it
// (net/http.CrossOriginProtection) and no session is opened.
func TestConsoleCrossOriginInBrowser(t *testing.T) {
	needBrowser(t)

	e := setup(t, true)
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte(`<!doctype html><form method="post" action="` + e.console.URL + `/signin"><input name="token" value="` + oncallToken + `"><button id="submit" type="submit">Go</button></form>`))
	}))
	t.Cleanup(other.Close)
	var seen struct {
		Status                  int
		URL, Error              string
		SignedIn, SignedInAfter int
	}
	runBrowser(t, "crossorigin.mjs", &seen, "CONSOLE_URL="+e.console.URL, "OTHER_URL="+other.URL)
	require.Equal(t, http.StatusForbidden, seen.Status)
	require.Equal(t, e.console.URL+"/signin", seen.URL)
	require.Equal(t, "cross-origin request refused", seen.Error)
	require.Zero(t, seen.SignedIn)
	require.Zero(t, seen.SignedInAfter, "no session was opened")
}
