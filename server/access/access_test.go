package access_test

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/policy"
)

var example = `
# The retention policy's sections are read by server/policy, not here.
defaults:
  message_retention: {min: 1h}
consumers:
  - prefix: orders.
    message_retention: {default: 10d}

identities:
  - name: billing
    uris: ["spiffe://prod.example/ns/billing/sa/payment-worker"]
    dns_names: ["Payment-Worker.billing.svc"]
    consumers: ["billing.payment-worker", "billing.refunds.*"]
  - name: orders
    subjects: ["CN=orders-inbox,O=Example"]
    token_hashes: ["` + ordersHash + `"]
    consumers: ["orders.*"]
  - name: oncall
    token_hashes: ["` + oncallHash + `"]
    admin: ["*"]
rate_limits:
  - consumers: ["orders.*"]
    rate: 200
    burst: 400
  - consumers: ["orders.eu.*", "billing.payment-worker"]
    rate: 0.5
  - consumers: ["*"]
    rate: 1000
`

var (
	ordersHash = access.HashToken("orders-secret-token")
	oncallHash = access.HashToken("oncall-secret-token")
)

func cert(uris []string, dns []string, subject pkix.Name) *x509.Certificate {
	c := &x509.Certificate{DNSNames: dns, Subject: subject}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		if err != nil {
			panic(err)
		}
		c.URIs = append(c.URIs, parsed)
	}
	return c
}

func TestParseAndMatch(t *testing.T) {
	set, err := access.Parse([]byte(example))
	require.NoError(t, err)
	require.True(t, set.Enforced())
	require.True(t, set.HasTokens())
	require.Equal(t, []string{"billing", "orders", "oncall"}, set.Identities())

	name := func(id *access.Identity, ok bool) string {
		if !ok {
			return ""
		}
		return id.Name
	}
	require.Equal(t, "billing", name(set.ByCertificate(cert([]string{"spiffe://other/x", "spiffe://prod.example/ns/billing/sa/payment-worker"}, nil, pkix.Name{}))))
	require.Equal(t, "billing", name(set.ByCertificate(cert(nil, []string{"payment-worker.billing.svc"}, pkix.Name{}))), "DNS names match without case")
	require.Equal(t, "orders", name(set.ByCertificate(cert(nil, nil, pkix.Name{CommonName: "orders-inbox", Organization: []string{"Example"}}))))
	require.Empty(t, name(set.ByCertificate(cert([]string{"spiffe://prod.example/ns/billing/sa/other"}, []string{"x.svc"}, pkix.Name{CommonName: "orders-inbox"}))))
	require.Equal(t, "orders", name(set.ByToken("orders-secret-token")))
	require.Equal(t, "oncall", name(set.ByToken("oncall-secret-token")))
	require.Empty(t, name(set.ByToken("orders-secret-token ")))
	require.Empty(t, name(set.ByToken(ordersHash)), "the hash is not the token")

	billing, _ := set.ByCertificate(cert(nil, []string{"payment-worker.billing.svc"}, pkix.Name{}))
	orders, _ := set.ByToken("orders-secret-token")
	oncall, _ := set.ByToken("oncall-secret-token")
	cases := []struct {
		name     string
		id       *access.Identity
		consumer string
		use      bool
		admin    bool
	}{
		{"exact name", billing, "billing.payment-worker", true, false},
		{"exact name is not a prefix", billing, "billing.payment-worker2", false, false},
		{"prefix", billing, "billing.refunds.eu", true, false},
		{"prefix needs its last byte", billing, "billing.refunds", false, false},
		{"another team's", billing, "orders.inbox", false, false},
		{"prefix of another team", orders, "orders.inbox", true, false},
		{"no admin grant", orders, "orders.inbox", true, false},
		{"admin only", oncall, "orders.inbox", false, true},
		{"admin everything", oncall, "billing.payment-worker", false, true},
		{"anonymous", access.Anonymous, "anything", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.use, tc.id.MayUse(tc.consumer))
			require.Equal(t, tc.admin, tc.id.MayAdminister(tc.consumer))
		})
	}

	limit := func(consumer string) string {
		l, ok := set.RateLimit(consumer)
		if !ok {
			return "none"
		}
		return l.String()
	}
	require.Equal(t, `0.5 requests per second, burst 1 (rate_limits "billing.payment-worker")`, limit("billing.payment-worker"))
	require.Equal(t, `0.5 requests per second, burst 1 (rate_limits "orders.eu.*")`, limit("orders.eu.inbox"), "the longest prefix wins")
	require.Equal(t, `200 requests per second, burst 400 (rate_limits "orders.*")`, limit("orders.inbox"))
	require.Equal(t, `1000 requests per second, burst 1000 (rate_limits "*")`, limit("payments.api"))
}

func TestParseOpen(t *testing.T) {
	for _, doc := range []string{"", "# nothing\n", "{}", "consumers: []", `{"defaults": {}}`} {
		set, err := access.Parse([]byte(doc))
		require.NoError(t, err, "%q", doc)
		require.False(t, set.Enforced())
		_, limited := set.RateLimit("x")
		require.False(t, limited)
	}
	set, err := access.Parse([]byte(`{"rate_limits": [{"consumers": ["*"], "rate": 5}]}`))
	require.NoError(t, err, "JSON is YAML")
	l, ok := set.RateLimit("x")
	require.True(t, ok)
	require.Equal(t, 5, l.Burst)
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name string
		doc  string
		want []string
	}{
		{"misspelt field", "identities:\n  - name: a\n    consumer: [x]\n    uris: [spiffe://a/b]", []string{"line 3", `unknown field "consumer"`}},
		{"bad name", "identities:\n  - name: 'a b'\n    uris: [spiffe://a/b]\n    consumers: [x]", []string{"identities[0]: name \"a b\""}},
		{"duplicate name", "identities:\n  - {name: a, uris: [spiffe://a/b], consumers: [x]}\n  - {name: a, uris: [spiffe://a/c], consumers: [x]}", []string{"identities[1] (a): name already used by identities[0]"}},
		{"no credential", "identities:\n  - {name: a, consumers: [x]}", []string{"no credential"}},
		{"no grant", "identities:\n  - {name: a, uris: [spiffe://a/b]}", []string{"grants nothing"}},
		{"bad pattern", "identities:\n  - {name: a, uris: [spiffe://a/b], consumers: ['bill ing']}", []string{"consumers[0]", "[A-Za-z0-9._:/-]"}},
		{"star inside", "identities:\n  - {name: a, uris: [spiffe://a/b], consumers: ['a*b']}", []string{"consumers[0]"}},
		{"shared credential", "identities:\n  - {name: a, uris: [spiffe://a/b], consumers: [x]}\n  - {name: b, uris: [spiffe://a/b], consumers: [y]}",
			[]string{"identities[1] (b): uris[0]: already given at identities[0] (a): uris[0]"}},
		{"not a URI", "identities:\n  - {name: a, uris: ['not a uri'], consumers: [x]}", []string{"uris[0]", "canonical form"}},
		{"plain token pasted", "identities:\n  - {name: a, token_hashes: [my-secret-token], consumers: [x]}", []string{"token_hashes[0]: not a token hash"}},
		{"zero rate", "rate_limits:\n  - {consumers: [x], rate: 0}", []string{"rate_limits[0]: rate must be a positive"}},
		{"negative burst", "rate_limits:\n  - {consumers: [x], rate: 1, burst: -1}", []string{"burst must be at least 1"}},
		{"duplicate rule", "rate_limits:\n  - {consumers: ['a.*'], rate: 1}\n  - {consumers: ['a.*'], rate: 2}", []string{`rate_limits[1]: consumers[0]: "a.*" is given twice`}},
		{"several errors at once", "identities:\n  - {name: a, consumers: [x]}\nrate_limits:\n  - {consumers: [x], rate: 0}", []string{"no credential", "rate must be"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := access.Parse([]byte(tc.doc))
			require.Error(t, err)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), "my-secret-token", "a pasted token is never echoed")
		})
	}
}

func TestLimiter(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	lim := access.NewLimiter(func() time.Time { return now })
	l := access.Limit{Rate: 2, Burst: 3, Pattern: "a.*"}

	for i := range 3 {
		ok, _ := lim.Allow("a.x", l)
		require.True(t, ok, "burst %d", i)
	}
	ok, wait := lim.Allow("a.x", l)
	require.False(t, ok)
	require.Equal(t, 500*time.Millisecond, wait, "one token every 1/rate")
	ok, _ = lim.Allow("a.y", l)
	require.True(t, ok, "every consumer has its own bucket")

	now = now.Add(500 * time.Millisecond)
	ok, _ = lim.Allow("a.x", l)
	require.True(t, ok)
	ok, _ = lim.Allow("a.x", l)
	require.False(t, ok, "a refused request takes no token: the next one is refused too")

	// A reload that raises the limit applies at once.
	ok, _ = lim.Allow("a.x", access.Limit{Rate: 100, Burst: 100, Pattern: "a.*"})
	require.False(t, ok, "the bucket keeps its tokens")
	now = now.Add(20 * time.Millisecond)
	ok, _ = lim.Allow("a.x", access.Limit{Rate: 100, Burst: 100, Pattern: "a.*"})
	require.True(t, ok, "and refills at the new rate")

	// Idle buckets are dropped once they would be full again.
	require.Equal(t, 2, lim.Len())
	now = now.Add(2 * time.Minute)
	ok, _ = lim.Allow("b", l)
	require.True(t, ok)
	require.Equal(t, 1, lim.Len())
}

// TestSharedFile checks that the config file is one file: the retention
// policy's parser accepts the sections of this package and this package's
// the policy's, while each still refuses unknown fields in its own.
func TestSharedFile(t *testing.T) {
	base := policy.Policy{
		Lease:              policy.Bounds{Default: 30 * time.Second, Min: time.Second, Max: time.Hour},
		MessageRetention:   policy.Bounds{Default: 7 * 24 * time.Hour, Min: time.Minute, Max: 30 * 24 * time.Hour},
		OperationRetention: policy.Bounds{Default: 24 * time.Hour, Min: time.Minute, Max: 30 * 24 * time.Hour},
	}
	set, err := policy.Parse([]byte(example), base)
	require.NoError(t, err)
	require.Equal(t, 10*24*time.Hour, set.For("orders.inbox").MessageRetention.Default)
	_, err = access.Parse([]byte(example))
	require.NoError(t, err)

	_, err = policy.Parse([]byte("identitiez: []\n"), base)
	require.ErrorContains(t, err, `unknown field "identitiez"`, "a misspelt section is caught by the policy's parser")
}

func TestMayAdministerUnder(t *testing.T) {
	set, err := access.Parse([]byte(`
identities:
  - {name: ops, token_hashes: ["` + access.HashToken("ops") + `"], admin: ["billing.*", "orders.inbox"]}
  - {name: root, token_hashes: ["` + access.HashToken("root") + `"], admin: ["*"]}
  - {name: user, token_hashes: ["` + access.HashToken("user") + `"], consumers: ["*"]}
`))
	require.NoError(t, err)
	ops, _ := set.ByToken("ops")
	root, _ := set.ByToken("root")
	user, _ := set.ByToken("user")
	for _, tc := range []struct {
		name      string
		id        *access.Identity
		prefix    string
		all, some bool
	}{
		{"everything, partly granted", ops, "", false, true},
		{"the granted prefix itself", ops, "billing.", true, true},
		{"inside the granted prefix", ops, "billing.eu.", true, true},
		{"wider than the granted prefix", ops, "bill", false, true},
		{"a granted name under the prefix", ops, "orders.", false, true},
		{"the granted name as prefix: longer names are not granted", ops, "orders.inbox", false, true},
		{"past the granted name", ops, "orders.inbox2", false, false},
		{"another team", ops, "payments.", false, false},
		{"admin everything", root, "anything", true, true},
		{"no admin grant", user, "", false, false},
		{"anonymous", access.Anonymous, "", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			all, some := tc.id.MayAdministerUnder(tc.prefix)
			require.Equal(t, tc.all, all, "all")
			require.Equal(t, tc.some, some, "some")
		})
	}
}

// TestLimiterShare: a limit shared by n live replicas fills each replica's
// bucket at 1/n of its rate, with 1/n of its burst (at least one), and a
// change of n (a replica joining or leaving) applies at once.
func TestLimiterShare(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	lim := access.NewLimiter(func() time.Time { return now })
	l := access.Limit{Rate: 30, Burst: 7, Pattern: "a.*"}

	allowed := func(l access.Limit, d time.Duration) int {
		n := 0
		for end := now.Add(d); now.Before(end); now = now.Add(time.Millisecond) {
			if ok, _ := lim.Allow("a.x", l); ok {
				n++
			}
		}
		return n
	}
	// A bucket's burst, then 10 a second: 3 + 99 in [0, 10 s).
	require.Equal(t, 3+99, allowed(l.Share(3), 10*time.Second))
	require.Contains(t, l.Share(3).String(), "one of 3 live replicas, this one allows 10 per second, burst 3")
	require.Equal(t, l, l.Share(1), "one replica takes the whole limit")
	require.Equal(t, l.String(), l.Share(1).String())

	// A replica leaves: the two left take half each, from now on.
	require.InDelta(t, 149, allowed(l.Share(2), 10*time.Second), 1)
	// A share never rounds the burst to nothing.
	_, _ = lim.Allow("b", access.Limit{Rate: 1, Burst: 1}.Share(8))
	ok, wait := lim.Allow("b", access.Limit{Rate: 1, Burst: 1}.Share(8))
	require.False(t, ok)
	require.Equal(t, 8*time.Second, wait)
}
