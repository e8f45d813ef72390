package policy_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

const day = 24 * time.Hour

// base is what the server's flags give by default.
func base() policy.Policy {
	return policy.Policy{
		Lease:              policy.Bounds{Default: 30 * time.Second, Min: time.Second, Max: time.Hour},
		MessageRetention:   policy.Bounds{Default: 7 * day, Min: time.Minute, Max: 30 * day},
		OperationRetention: policy.Bounds{Default: day, Min: time.Minute, Max: 30 * day},
	}
}

const example = `
# The example of docs/retention.md.
defaults:
  message_retention: {min: 1h}
consumers:
  - name: billing.payment-worker
    operation_retention: {default: 3d, min: 2d}
    lease: {default: 2m}
  - prefix: orders.
    message_retention: {min: 8d, default: 10d}
  - prefix: orders.eu.
    message_retention: {min: 15d, default: 15d, max: 60d}
  - name: orders.eu.audit
    message_retention: {default: 30d}
`

func TestParseAndMatch(t *testing.T) {
	set, err := policy.Parse([]byte(example), base())
	require.NoError(t, err)
	require.Equal(t, 4, set.Len())

	d := set.Defaults()
	require.Equal(t, policy.DefaultsSource, d.Source)
	require.Equal(t, policy.Bounds{Default: 7 * day, Min: time.Hour, Max: 30 * day}, d.MessageRetention, "defaults override the flags field by field")
	require.Equal(t, base().OperationRetention, d.OperationRetention)

	cases := []struct {
		name      string
		consumer  string
		source    string
		message   policy.Bounds
		operation policy.Bounds
		lease     time.Duration
	}{
		{"no match", "payments.api", policy.DefaultsSource, d.MessageRetention, d.OperationRetention, 30 * time.Second},
		{"exact", "billing.payment-worker", `consumer "billing.payment-worker"`,
			d.MessageRetention, policy.Bounds{Default: 3 * day, Min: 2 * day, Max: 30 * day}, 2 * time.Minute},
		{"exact name is not a prefix", "billing.payment-worker.v2", policy.DefaultsSource, d.MessageRetention, d.OperationRetention, 30 * time.Second},
		{"prefix", "orders.inbox", `prefix "orders."`,
			policy.Bounds{Default: 10 * day, Min: 8 * day, Max: 30 * day}, d.OperationRetention, 30 * time.Second},
		{"longest prefix wins", "orders.eu.inbox", `prefix "orders.eu."`,
			policy.Bounds{Default: 15 * day, Min: 15 * day, Max: 60 * day}, d.OperationRetention, 30 * time.Second},
		{"exact beats prefix, inherits the defaults, not the prefix", "orders.eu.audit", `consumer "orders.eu.audit"`,
			policy.Bounds{Default: 30 * day, Min: time.Hour, Max: 30 * day}, d.OperationRetention, 30 * time.Second},
		{"prefix is case sensitive", "Orders.inbox", policy.DefaultsSource, d.MessageRetention, d.OperationRetention, 30 * time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := set.For(tc.consumer)
			require.Equal(t, tc.source, p.Source)
			require.Equal(t, tc.message, p.Retention(storage.KindMessage))
			require.Equal(t, tc.operation, p.Retention(storage.KindOperation))
			require.Equal(t, tc.lease, p.Lease.Default)
		})
	}
}

func TestParseJSON(t *testing.T) {
	set, err := policy.Parse([]byte(`{"consumers": [{"prefix": "a.", "lease": {"default": "1m", "max": "2h"}}]}`), base())
	require.NoError(t, err)
	require.Equal(t, policy.Bounds{Default: time.Minute, Min: time.Second, Max: 2 * time.Hour}, set.For("a.b").Lease)
}

// TestParseBesideAccess reads a file that also holds the sections of
// server/access: they are left to that package, and other unknown
// sections are still errors.
func TestParseBesideAccess(t *testing.T) {
	doc := `
identities:
  - name: billing
    token_hashes: ["sha256:00"]
    consumers: ["billing.*"]
rate_limits:
  - {consumers: ["*"], rate: 100}
consumers:
  - prefix: billing.
    lease: {default: 1m}
`
	set, err := policy.Parse([]byte(doc), base())
	require.NoError(t, err)
	require.Equal(t, time.Minute, set.For("billing.x").Lease.Default)
	_, err = policy.Parse([]byte("identity: []\n"), base())
	require.ErrorContains(t, err, `unknown field "identity"`)
}

func TestParseMaxLeaseTotal(t *testing.T) {
	b := base()
	b.MaxLeaseTotal = 24 * time.Hour
	set, err := policy.Parse([]byte("defaults:\n  max_lease_total: 12h\nconsumers:\n  - {name: a, max_lease_total: 2d}\n  - {name: b, max_lease_total: 0s}\n  - {name: c}\n"), b)
	require.NoError(t, err)
	for consumer, want := range map[string]time.Duration{"a": 48 * time.Hour, "b": 0, "c": 12 * time.Hour, "d": 12 * time.Hour} {
		require.Equal(t, want, set.For(consumer).MaxLeaseTotal, consumer)
	}
}

// TestParseQuotas: max_records and max_bytes under defaults and per entry,
// inherited like every bound; absent or 0 is no quota.
func TestParseQuotas(t *testing.T) {
	doc := "defaults:\n  max_records: 100\nconsumers:\n" +
		"  - {name: a, max_records: 3, max_bytes: 4096}\n  - {name: b, max_records: 0}\n  - {prefix: p., max_bytes: 10}\n"
	set, err := policy.Parse([]byte(doc), base())
	require.NoError(t, err)
	cases := []struct {
		consumer       string
		records, bytes int64
		hasQuota       bool
	}{
		{"a", 3, 4096, true},
		{"b", 0, 0, false},
		{"p.x", 100, 10, true},
		{"other", 100, 0, true},
	}
	for _, tc := range cases {
		p := set.For(tc.consumer)
		require.Equal(t, tc.records, p.MaxRecords, tc.consumer)
		require.Equal(t, tc.bytes, p.MaxBytes, tc.consumer)
		require.Equal(t, tc.hasQuota, p.HasQuota(), tc.consumer)
	}
	set, err = policy.Parse(nil, base())
	require.NoError(t, err)
	require.False(t, set.For("x").HasQuota(), "no quota by default")
}

// TestParseMaxAttempts: max_attempts under defaults and per entry,
// inherited like every bound; absent or 0 is unbounded.
func TestParseMaxAttempts(t *testing.T) {
	doc := "defaults:\n  max_attempts: 5\nconsumers:\n  - {name: a, max_attempts: 1}\n  - {name: b, max_attempts: 0}\n  - {prefix: p.}\n"
	set, err := policy.Parse([]byte(doc), base())
	require.NoError(t, err)
	for consumer, want := range map[string]int64{"a": 1, "b": 0, "p.x": 5, "other": 5} {
		require.Equal(t, want, set.For(consumer).MaxAttempts, consumer)
	}
	set, err = policy.Parse(nil, base())
	require.NoError(t, err)
	require.Zero(t, set.For("x").MaxAttempts, "unbounded by default")
}

func TestParseEmpty(t *testing.T) {
	for _, doc := range []string{"", "# nothing\n", "{}", "consumers: []"} {
		set, err := policy.Parse([]byte(doc), base())
		require.NoError(t, err, "%q", doc)
		require.Zero(t, set.Len())
		require.Equal(t, base().MessageRetention, set.For("x").MessageRetention)
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name string
		doc  string
		want []string
	}{
		{"unknown top-level field", "default: {}", []string{`unknown field "default"`}},
		{"misspelt bound", "defaults:\n  message_retention: {minimum: 1h}", []string{"line 2", `unknown field "minimum"`}},
		{"misspelt kind in a consumer", "consumers:\n  - name: a\n    message_retension: {min: 1h}", []string{"line 3", `unknown field "message_retension"`}},
		{"number for a duration", "defaults:\n  lease: {default: 30}", []string{"line 2", `a duration is a string with a unit`}},
		{"bad duration", "defaults:\n  lease: {default: 30x}", []string{"line 2", `"30x"`}},
		{"fractional days", "defaults:\n  lease: {default: 1.5d}", []string{"days must be a whole number"}},
		{"neither name nor prefix", "consumers:\n  - lease: {default: 1m}", []string{"consumers[0]: needs exactly one of name or prefix"}},
		{"both name and prefix", "consumers:\n  - {name: a, prefix: b}", []string{"consumers[0]: needs exactly one of name or prefix"}},
		{"bad consumer name", "consumers:\n  - name: billing worker", []string{"consumers[0]: name:", "[A-Za-z0-9._:/-]"}},
		{"duplicate prefix", "consumers:\n  - prefix: a.\n  - prefix: a.", []string{`consumers[1]: prefix "a." is already given by consumers[0]`}},
		{"default below min", "consumers:\n  - name: a\n    message_retention: {default: 1h, min: 2h}",
			[]string{`consumers[0]: consumer "a": message_retention.default 1h0m0s is below message_retention.min 2h0m0s`}},
		{"inherited default above a lowered max", "consumers:\n  - prefix: a\n    operation_retention: {max: 12h}",
			[]string{`prefix "a": operation_retention.default 1d is above operation_retention.max 12h0m0s`}},
		{"max below min", "defaults:\n  lease: {min: 1m, max: 30s}", []string{"defaults:", "lease.max 30s is below lease.min 1m0s"}},
		{"zero min", "defaults:\n  message_retention: {min: 0s}", []string{"message_retention.min must be positive"}},
		{"every error is reported", "consumers:\n  - name: a\n    lease: {default: 2h}\n  - name: b\n    lease: {default: 0s, min: 0s}",
			[]string{"consumers[0]", "lease.default 2h0m0s is above lease.max 1h0m0s", "consumers[1]", "lease.min must be positive"}},
		{"two documents", "consumers: []\n---\nconsumers: []", []string{"more than one YAML document"}},
		{"max lease total below the max lease", "consumers:\n  - name: a\n    max_lease_total: 30m",
			[]string{`consumers[0]: consumer "a": max_lease_total 30m0s is below lease.max 1h0m0s`}},
		{"negative max lease total", "defaults:\n  max_lease_total: -1h", []string{"max_lease_total must not be negative"}},
		{"negative max records", "consumers:\n  - {name: a, max_records: -1}", []string{`consumer "a": max_records must not be negative`}},
		{"negative max attempts", "consumers:\n  - {name: a, max_attempts: -1}", []string{`consumer "a": max_attempts must not be negative`}},
		{"max attempts not a number", "defaults:\n  max_attempts: many", []string{"line 2"}},
		{"negative max bytes", "defaults:\n  max_bytes: -5", []string{"defaults:", "max_bytes must not be negative"}},
		{"max bytes with a unit", "defaults:\n  max_bytes: 1GiB", []string{"line 2"}},
		{"not a mapping", "- a\n- b", []string{"line 1: expected a mapping with defaults and consumers, found a YAML seq"}},
		{"consumers not a list", "consumers: {name: a}", []string{"line 1: expected a list of consumer entries, found a YAML map"}},
		{"bounds not a mapping", "defaults:\n  lease: 30s", []string{"line 2: expected a mapping with default, min and max, found a YAML str"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := policy.Parse([]byte(tc.doc), base())
			require.Error(t, err)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), "yaml:", "the library's prefix is dropped")
		})
	}
}

func TestParseDuration(t *testing.T) {
	cases := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"30s", 30 * time.Second, true},
		{"1h30m", 90 * time.Minute, true},
		{"7d", 7 * day, true},
		{"1d12h", 36 * time.Hour, true},
		{"0d", 0, true},
		{"d", 0, false},
		{"-1d", 0, false},
		{"1d-1h", 0, false},
		{"1.5d", 0, false},
		{"7", 0, false},
		{"106751d", 106751 * day, true},
		{"106752d", 0, false},
		{"106751d24h", 0, false},
		{"99999999999999999999d", 0, false},
	}
	for _, tc := range cases {
		got, err := policy.ParseDuration(tc.in)
		if !tc.ok {
			require.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, got, tc.in)
	}
	require.Equal(t, "7d", policy.FormatDuration(7*day))
	require.Equal(t, "36h0m0s", policy.FormatDuration(36*time.Hour))

	// A bad value says what is accepted, not time's bare "unknown unit".
	for _, in := range []string{"7x", "seven days", "1d7x"} {
		_, err := policy.ParseDuration(in)
		require.ErrorContains(t, err, `like "90s", "1h30m", "7d" or "1d12h"`, in)
	}
}

func TestNewSet(t *testing.T) {
	set, err := policy.NewSet(base())
	require.NoError(t, err)
	require.Equal(t, policy.DefaultsSource, set.For("anyone").Source)
	bad := base()
	bad.Lease.Default = 2 * time.Hour
	_, err = policy.NewSet(bad)
	require.ErrorContains(t, err, "lease.default")
}

// FuzzParse checks that no file makes Parse panic, and that every set it
// accepts gives every consumer a policy whose bounds hold together.
func FuzzParse(f *testing.F) {
	f.Add(example, "orders.eu.inbox")
	f.Add(`{"consumers": [{"prefix": "a.", "lease": {"default": "1m"}}]}`, "a.b")
	f.Add("defaults:\n  message_retention: {min: 1d12h}\n", "x")
	f.Add("consumers:\n  - name: a\n    lease: {default: 2h}\n", "a")
	f.Fuzz(func(t *testing.T, doc, consumer string) {
		set, err := policy.Parse([]byte(doc), base())
		if err != nil {
			return
		}
		p := set.For(consumer)
		require.NoError(t, p.Validate(), "an accepted file gave %q an invalid policy", consumer)
		require.NoError(t, set.Defaults().Validate())
	})
}

// TestLongestLease: the largest lease.max of the defaults and of every
// entry, names and prefixes alike.
func TestLongestLease(t *testing.T) {
	set, err := policy.Parse([]byte(example), base())
	require.NoError(t, err)
	require.Equal(t, time.Hour, set.LongestLease(), "no entry raises the flags' max lease")
	for _, doc := range []string{
		"consumers:\n  - {name: a.b, lease: {max: 3h}}\n",
		"consumers:\n  - {prefix: a., lease: {max: 3h}}\n  - {name: b.c, lease: {max: 2h}}\n",
		"defaults:\n  lease: {max: 3h}\n",
	} {
		set, err := policy.Parse([]byte(doc), base())
		require.NoError(t, err, doc)
		require.Equal(t, 3*time.Hour, set.LongestLease(), doc)
	}
}
