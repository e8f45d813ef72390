package console_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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

// TestConsoleInBrowser clicks through the console in headless Chromium,
// driven by Playwright, against a real server: sign in, look up a claimed
// key whose name is markup, invalidate it with a reason through the
// confirmation, and see its new state. Without Chromium, node or
// node_modules it skips, except in CI (CI set), where it fails.
func TestConsoleInBrowser(t *testing.T) {
	var missing string
	if _, err := os.Stat(chromium); err != nil {
		missing = chromium + " (apt-get install chromium)"
	} else if _, err := exec.LookPath("node"); err != nil {
		missing = "node"
	} else if _, err := os.Stat(filepath.Join(browserDir, "node_modules", "playwright-core")); err != nil {
		missing = filepath.Join("server/console", browserDir, "node_modules/playwright-core") + " (npm ci in " + filepath.Join("server/console", browserDir) + ")"
	}
	if missing != "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("browser test cannot run in CI: %s is missing; .ci/run should have installed it", missing)
		}
		t.Skipf("SKIPPED: the browser test needs %s", missing)
	}

	e := setup(t, true)
	const key = `charge:<img src=x onerror=alert("xss")>`
	claimed := e.claim(t, key, "worker-<b>7</b>")
	screenshot := filepath.Join(artifactDir(t), "console-invalidated.png")
	_ = os.Remove(screenshot)
	const reason = "worker-7 crashed with a long lease, OPS-7"

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "console.mjs")
	cmd.Dir = browserDir
	cmd.Env = append(os.Environ(),
		"CONSOLE_URL="+e.console.URL, "TOKEN="+oncallToken, "CONSUMER="+consumer, "KEY="+key, "REASON="+reason,
		"CHROMIUM="+chromium, "USER_DATA_DIR="+t.TempDir(), "SCREENSHOT="+screenshot)
	out, err := cmd.Output()
	var stderr []byte
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = ee.Stderr
	}
	require.NoError(t, err, "node console.mjs: %s%s", out, stderr)

	var seen struct {
		Identity, StoreHealth, KeyShown, HolderShown string
		StateBefore, TokenBefore, ConfirmReason      string
		Notice, StateAfter, TokenAfter               string
		Dialogs                                      []struct{ Type, Message string }
		ConsoleErrors                                []string
	}
	require.NoError(t, json.Unmarshal(out, &seen), "%s", out)
	t.Logf("screenshot: %s", screenshot)
	require.FileExists(t, screenshot)

	require.Equal(t, "oncall", seen.Identity)
	require.Equal(t, "SERVING", seen.StoreHealth)
	require.Equal(t, key, seen.KeyShown, "the key is shown as text")
	require.Equal(t, "worker-<b>7</b>", seen.HolderShown)
	require.Equal(t, "STATE_IN_PROGRESS", seen.StateBefore)
	require.Equal(t, strconv.FormatInt(claimed.GetToken(), 10), seen.TokenBefore)
	require.Equal(t, reason, seen.ConfirmReason)
	require.Len(t, seen.Dialogs, 1, "only the confirmation, no alert from the key: %v", seen.Dialogs)
	require.Equal(t, "confirm", seen.Dialogs[0].Type)
	require.Contains(t, seen.Notice, "Invalidated")

	rec := e.inspect(t, key)
	require.Greater(t, rec.GetToken(), claimed.GetToken())
	require.Equal(t, strconv.FormatInt(rec.GetToken(), 10), seen.TokenAfter, "the page shows the record after the invalidation")
	require.Equal(t, "STATE_IN_PROGRESS", seen.StateAfter)
	var audited bool
	for _, l := range e.logs.lines(t, "admin action") {
		audited = audited || (l["action"] == "invalidate" && l["reason"] == reason && l["identity"] == "oncall")
	}
	require.True(t, audited, "the invalidation is in the audit log")
	require.Empty(t, seen.ConsoleErrors, "no script or policy error in the page")
}
