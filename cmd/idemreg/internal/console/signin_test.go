package console_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/server/access"
)

// TestSignIns: a console takes tokens when some identity has token
// hashes, and its proxy's users when the proxy's flags name a header; a
// console nobody could sign in to, or a proxy with no identities to map
// to, is refused, and so are the proxy's flags without its header.
func TestSignIns(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte(proxySecret+"\n"), 0o600))
	proxy := console.ProxyConfig{Header: proxyHeader, Users: "alice@example.com=oncall, *@shipping.example.com=shipping", SecretFile: secret, From: "10.0.0.0/8, 192.168.1.7"}
	certOnly, err := access.Parse([]byte("identities:\n  - {name: svc, dns_names: [svc.example], admin: [\"billing.*\"]}\n"))
	require.NoError(t, err)
	const listen = "127.0.0.1:7351"

	cases := []struct {
		name             string
		set              *access.Set
		proxy            console.ProxyConfig
		err              string
		tokens, viaProxy bool
	}{
		{name: "tokens", set: testIdentities, tokens: true},
		{name: "tokens and proxy", set: testIdentities, proxy: proxy, tokens: true, viaProxy: true},
		{name: "certificates and proxy", set: certOnly, proxy: console.ProxyConfig{Header: proxyHeader, Users: "*=svc", SecretFile: secret}, viaProxy: true},
		{name: "certificates alone", set: certOnly, err: "all authenticate by client certificate"},
		{name: "no identities and proxy", set: access.Open(), proxy: proxy, err: "the server has no identities"},
		{name: "no identities", set: access.Open()},
		{name: "proxy flags without the header", set: testIdentities, proxy: console.ProxyConfig{Users: "*=oncall"}, err: "need --console-proxy-header"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			current := func() *access.Set { return tc.set }
			signIn, p, err := console.SignIns(tc.proxy, listen, current)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.NoError(t, tc.proxy.Validate(listen))
			require.Equal(t, tc.tokens, signIn != nil, "sign-in by token")
			require.Equal(t, tc.viaProxy, p != nil, "sign-in by proxy")
			if p == nil {
				return
			}
			require.Equal(t, proxyHeader, p.Header)
			require.Equal(t, proxySecret, string(p.Secret), "read without the newline")
			if tc.proxy.From != "" {
				require.Len(t, p.Trusted, 2)
				require.Equal(t, "192.168.1.7/32", p.Trusted[1].String())
			}
			if tc.set == testIdentities {
				id, err := p.Identity("someone@shipping.example.com")
				require.NoError(t, err)
				require.Equal(t, "shipping", id)
				_, err = p.Identity("mallory@example.org")
				require.ErrorIs(t, err, console.ErrUnmappedUser)
			}
		})
	}
}
