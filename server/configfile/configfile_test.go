package configfile_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/policy"
)

var base = policy.Policy{
	Lease:              policy.Bounds{Default: 30 * time.Second, Min: time.Second, Max: time.Hour},
	MessageRetention:   policy.Bounds{Default: 7 * 24 * time.Hour, Min: time.Minute, Max: 30 * 24 * time.Hour},
	OperationRetention: policy.Bounds{Default: 24 * time.Hour, Min: time.Minute, Max: 30 * 24 * time.Hour},
}

func TestParse(t *testing.T) {
	token := access.HashToken("t")
	cases := []struct {
		name string
		doc  string
		// wantErrs must all appear in the error; none means valid.
		wantErrs []string
	}{
		{name: "empty", doc: ""},
		{name: "both parts", doc: "consumers:\n  - {name: a.b, lease: {default: 1m}}\nidentities:\n  - {name: a, token_hashes: [\"" + token + "\"], consumers: [\"a.*\"]}\n"},
		{name: "errors of both parts together", doc: "consumers:\n  - {name: a.b, lease: {default: 2h}}\nrate_limits:\n  - {consumers: [\"a.*\"], rate: -1}\n",
			wantErrs: []string{`consumers[0]: consumer "a.b": lease.default 2h0m0s is above lease.max 1h0m0s`, "rate_limits[0]: rate must be a positive number"}},
		{name: "unknown section", doc: "rate_limit:\n  - {consumers: [\"a.*\"], rate: 1}\n", wantErrs: []string{`unknown field "rate_limit"`}},
		{name: "unknown field in an access section", doc: "identities:\n  - {name: a, tokens: [\"x\"]}\n", wantErrs: []string{`unknown field "tokens"`}},
		{name: "unknown field in a policy section", doc: "defaults:\n  leases: {}\n", wantErrs: []string{`unknown field "leases"`}},
		{name: "two documents", doc: "consumers: []\n---\nconsumers: []\n", wantErrs: []string{"more than one YAML document"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := configfile.Parse([]byte(tc.doc), base)
			if len(tc.wantErrs) == 0 {
				require.NoError(t, err)
				require.NotNil(t, c.Policy)
				require.NotNil(t, c.Access)
				return
			}
			require.Error(t, err)
			for _, want := range tc.wantErrs {
				require.Contains(t, err.Error(), want)
			}
		})
	}
}

// TestReloadWholeOrNothing: a reload replaces both parts in one swap, or
// neither.
func TestReloadWholeOrNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	identity := "identities:\n  - {name: a, token_hashes: [\"" + access.HashToken("t") + "\"], consumers: [\"a.*\"]}\n"
	write("consumers:\n  - {name: a.b, lease: {default: 1m}}\n" + identity)
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	first := src.Current()
	require.Equal(t, time.Minute, src.Current().Policy.For("a.b").Lease.Default)

	cases := []struct {
		name, doc, wantErr string
	}{
		{"valid policy, invalid access", "consumers:\n  - {name: a.b, lease: {default: 2m}}\n" + identity + "rate_limits:\n  - {consumers: [a.b], rate: 0}\n", "rate must be a positive number"},
		{"invalid policy, valid access", "consumers:\n  - {name: a.b, lease: {default: 2h}}\n" + identity + "rate_limits:\n  - {consumers: [a.b], rate: 5}\n", "lease.default 2h0m0s is above lease.max"},
		{"authentication turned off", "consumers:\n  - {name: a.b, lease: {default: 2m}}\n", "cannot turn authentication on or off"},
		{"unreadable", "consumers: [", "config file"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			write(tc.doc)
			_, err := src.Reload()
			require.ErrorContains(t, err, tc.wantErr)
			require.Same(t, first, src.Current())
			require.Same(t, first.Policy, src.Current().Policy)
			require.Same(t, first.Access, src.Current().Access)
		})
	}

	write("consumers:\n  - {name: a.b, lease: {default: 2m}}\n" + identity + "rate_limits:\n  - {consumers: [a.b], rate: 5}\n")
	got, err := src.Reload()
	require.NoError(t, err)
	require.Same(t, got, src.Current())
	require.Equal(t, 2*time.Minute, src.Current().Policy.For("a.b").Lease.Default)
	l, ok := src.Current().Access.RateLimit("a.b")
	require.True(t, ok)
	require.Equal(t, 5.0, l.Rate)
}

// TestReloadAccess: a reload replaces the identities (a rotated token
// stops working), never turns authentication on or off, and an invalid
// file changes nothing.
func TestReloadAccess(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	write := func(doc string) { require.NoError(t, os.WriteFile(path, []byte(doc), 0o600)) }
	write("identities:\n  - {name: a, token_hashes: ['" + access.HashToken("t1") + "'], consumers: [x]}\n")
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	_, ok := src.Current().Access.ByToken("t1")
	require.True(t, ok)

	write("identities:\n  - {name: a, token_hashes: ['" + access.HashToken("t2") + "'], consumers: [x]}\n")
	_, err = src.Reload()
	require.NoError(t, err)
	_, ok = src.Current().Access.ByToken("t1")
	require.False(t, ok, "a rotated token stops working at the reload")
	_, ok = src.Current().Access.ByToken("t2")
	require.True(t, ok)

	write("identities: []\n")
	_, err = src.Reload()
	require.ErrorIs(t, err, access.ErrModeChange, "a reload cannot open the server")
	require.True(t, src.Current().Access.Enforced())

	write("identities: [{name: a}]\n")
	_, err = src.Reload()
	require.ErrorContains(t, err, "no credential")
	_, ok = src.Current().Access.ByToken("t2")
	require.True(t, ok, "an invalid file changes nothing")
}

// TestReloadPolicy: an invalid policy leaves the one in force, a valid
// one replaces it, a missing file is an error, not an empty policy.
func TestReloadPolicy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(s string) { require.NoError(t, os.WriteFile(path, []byte(s), 0o600)) }
	write("consumers:\n  - prefix: a.\n    lease: {default: 1m}\n")
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	require.Equal(t, path, src.Path())
	first := src.Current().Policy
	require.Equal(t, time.Minute, first.For("a.x").Lease.Default)

	write("consumers:\n  - prefix: a.\n    lease: {default: 2h}\n") // above the max
	_, err = src.Reload()
	require.ErrorContains(t, err, "lease.default 2h0m0s is above lease.max 1h0m0s")
	require.ErrorContains(t, err, path, "the error names the file")
	require.Same(t, first, src.Current().Policy, "an invalid file leaves the policy in force")

	write("consumers:\n  - prefix: a.\n    lease: {default: 5m}\n")
	c, err := src.Reload()
	require.NoError(t, err)
	set := c.Policy
	require.Same(t, set, src.Current().Policy)
	require.Equal(t, 5*time.Minute, src.Current().Policy.For("a.x").Lease.Default)

	require.NoError(t, os.Remove(path))
	_, err = src.Reload()
	require.Error(t, err, "a missing file is an error, not an empty policy")
	require.Same(t, set, src.Current().Policy)

	_, err = configfile.Open(path, base)
	require.Error(t, err)
}

// TestStatic: a static source holds its config and has nothing to reload.
func TestStatic(t *testing.T) {
	set, err := policy.NewSet(base)
	require.NoError(t, err)
	c := &configfile.Config{Policy: set, Access: access.Open()}
	src := configfile.Static(c)
	require.Empty(t, src.Path())
	got, err := src.Reload()
	require.NoError(t, err)
	require.Same(t, c, got)
	require.Same(t, c, src.Current())
}

// TestOpenWithoutAFile: no path is base for every consumer and no
// identities, with nothing to reload (serve without --config).
func TestOpenWithoutAFile(t *testing.T) {
	src, err := configfile.Open("", base)
	require.NoError(t, err)
	require.Empty(t, src.Path())
	c := src.Current()
	require.False(t, c.Access.Enforced())
	require.Equal(t, base.Lease, c.Policy.For("any.consumer").Lease)
	got, err := src.Reload()
	require.NoError(t, err)
	require.Same(t, c, got)
}

// configMap lays a file out as the kubelet mounts a ConfigMap: the file is
// a symlink into ..data, itself a symlink to a timestamped directory, and
// an update writes a new directory and swaps ..data in one rename.
type configMap struct {
	t   *testing.T
	dir string
	n   int
}

func newConfigMap(t *testing.T, doc string) (*configMap, string) {
	m := &configMap{t: t, dir: t.TempDir()}
	m.update(doc)
	require.NoError(t, os.Symlink(filepath.Join("..data", "idemreg.yaml"), filepath.Join(m.dir, "idemreg.yaml")))
	return m, filepath.Join(m.dir, "idemreg.yaml")
}

func (m *configMap) update(doc string) {
	m.n++
	ts := filepath.Join(m.dir, "..2026_12_04_13_00_0"+string(rune('0'+m.n)))
	require.NoError(m.t, os.Mkdir(ts, 0o755))
	require.NoError(m.t, os.WriteFile(filepath.Join(ts, "idemreg.yaml"), []byte(doc), 0o644))
	tmp := filepath.Join(m.dir, "..data_tmp")
	require.NoError(m.t, os.Symlink(filepath.Base(ts), tmp))
	require.NoError(m.t, os.Rename(tmp, filepath.Join(m.dir, "..data")))
}

// TestReloadIfChanged: a poll takes a file whose content changed, through
// a ConfigMap's symlink swap too; refuses a broken one once and keeps the
// config in force; and does nothing while the content stays.
func TestReloadIfChanged(t *testing.T) {
	m, path := newConfigMap(t, "consumers:\n  - {name: a.b, lease: {default: 1m}}\n")
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	first := src.Current()
	require.Len(t, first.Version, 12)
	// Polls a second apart that take a content read the same for a second:
	// the first poll after a change only reads it (settling).
	now := time.Unix(1_700_000_000, 0)
	poll := func() (*configfile.Config, bool, error) {
		now = now.Add(time.Second)
		return src.ReloadIfChanged(now, time.Second)
	}
	settling := func() {
		t.Helper()
		_, changed, err := poll()
		require.NoError(t, err)
		require.False(t, changed, "a change is taken once a second poll reads it the same")
	}

	_, changed, err := poll()
	require.NoError(t, err)
	require.False(t, changed, "nothing changed on disk")
	require.Same(t, first, src.Current())

	m.update("consumers:\n  - {name: a.b, lease: {default: 2m}}\n")
	settling()
	got, changed, err := poll()
	require.NoError(t, err)
	require.True(t, changed, "the ..data swap is a change")
	require.Same(t, got, src.Current())
	require.Equal(t, 2*time.Minute, src.Current().Policy.For("a.b").Lease.Default)
	require.NotEqual(t, first.Version, got.Version)

	m.update("consumers:\n  - {name: a.b, lease: {default: 2h}}\n") // above lease.max
	settling()
	_, changed, err = poll()
	require.True(t, changed)
	require.ErrorContains(t, err, "lease.default 2h0m0s is above lease.max")
	require.Same(t, got, src.Current(), "a broken file changes nothing")
	_, changed, err = poll()
	require.NoError(t, err)
	require.False(t, changed, "a refused file is refused once, not on every poll")
	require.Same(t, got, src.Current())

	// A file written in place (an editor, a config management tool).
	target, err := filepath.EvalSymlinks(path)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(target, []byte("consumers:\n  - {name: a.b, lease: {default: 3m}}\n"), 0o644))
	settling()
	_, changed, err = poll()
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, 3*time.Minute, src.Current().Policy.For("a.b").Lease.Default)

	// Gone for a moment: said once, the config in force kept, and taken
	// again when it is back.
	require.NoError(t, os.Remove(target))
	_, changed, err = poll()
	require.True(t, changed)
	require.ErrorContains(t, err, "no such file")
	_, changed, err = poll()
	require.NoError(t, err)
	require.False(t, changed)
	require.Equal(t, 3*time.Minute, src.Current().Policy.For("a.b").Lease.Default)
	m.update("consumers:\n  - {name: a.b, lease: {default: 4m}}\n")
	settling()
	_, changed, err = poll()
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, 4*time.Minute, src.Current().Policy.For("a.b").Lease.Default)
}

// TestReloadIfChangedWaitsForTheFileToSettle: a file written in place in
// two parts is read between them, and its first part parses (one identity
// of two). A poll takes no content that has not read the same for the
// settling time, so the half file is never taken, and the whole one is
// once it has settled (issue 35, weakness 6).
func TestReloadIfChangedWaitsForTheFileToSettle(t *testing.T) {
	identity := func(name string) string {
		return "  - {name: " + name + ", token_hashes: [\"" + access.HashToken(name+"-token") + "\"], consumers: [\"" + name + ".*\"]}\n"
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "idemreg.yaml")
	whole := "identities:\n" + identity("orders") + identity("billing")
	require.NoError(t, os.WriteFile(path, []byte(whole), 0o600))
	src, err := configfile.Open(path, base)
	require.NoError(t, err)
	inForce := src.Current()
	const settle = 10 * time.Second
	now := time.Unix(1_700_000_000, 0)
	pollAt := func(after time.Duration) (bool, error) {
		now = now.Add(after)
		_, changed, err := src.ReloadIfChanged(now, settle)
		return changed, err
	}

	// The rewrite's first part: it parses, and names orders alone.
	half := "identities:\n" + identity("orders")
	_, err = configfile.Parse([]byte(half), base)
	require.NoError(t, err, "the half file must parse, or the test shows nothing")
	require.NoError(t, os.WriteFile(path, []byte(half), 0o600))
	for range 3 { // read the same by polls over less than the settling time
		changed, err := pollAt(settle / 4)
		require.NoError(t, err)
		require.False(t, changed)
		require.Same(t, inForce, src.Current(), "a content not yet settled is not taken")
	}
	// The second part lands before the half has settled: the wait starts
	// again from the whole file.
	rewritten := whole + "rate_limits:\n  - {identities: [billing], rate: 5}\n"
	require.NoError(t, os.WriteFile(path, []byte(rewritten), 0o600))
	changed, err := pollAt(settle / 2)
	require.NoError(t, err)
	require.False(t, changed, "the half file's wait does not count for the whole one")
	require.Same(t, inForce, src.Current())
	changed, err = pollAt(settle / 2)
	require.NoError(t, err)
	require.False(t, changed)
	changed, err = pollAt(settle / 2)
	require.NoError(t, err)
	require.True(t, changed, "the whole file is taken once it has read the same for the settling time")
	_, ok := src.Current().Access.ByName("billing")
	require.True(t, ok)

	// Written back to the content in force before it settles: nothing to
	// take, and nothing pending.
	require.NoError(t, os.WriteFile(path, []byte(half), 0o600))
	changed, err = pollAt(time.Second)
	require.NoError(t, err)
	require.False(t, changed)
	require.NoError(t, os.WriteFile(path, []byte(rewritten), 0o600))
	changed, err = pollAt(2 * settle)
	require.NoError(t, err)
	require.False(t, changed)
	_, ok = src.Current().Access.ByName("billing")
	require.True(t, ok, "the half file never applied")
}
