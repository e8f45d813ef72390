package console

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"strings"

	"github.com/idemreg/idemreg/server/access"
)

// ProxyConfig is the sign-in by a trusted proxy's header as serve's
// command line gives it (--console-proxy-*), to be checked (Validate) and
// made into the console's ProxySignIn (SignIns). Its errors name the
// flags.
type ProxyConfig struct {
	// Header names the proxy's header; empty turns proxy sign-in off, and
	// the header is then ignored.
	Header string
	// Users maps the header's users to identities: USER=IDENTITY,
	// comma-separated (ParseUserMap).
	Users string
	// SecretFile holds the secret the proxy sends in ProxySecretHeader;
	// required with Header.
	SecretFile string
	// From are the proxy's source addresses (CIDRs or addresses,
	// comma-separated), believed besides the secret; empty: any.
	From string
}

// Validate checks c against the console's address (listen, empty when
// there is no console), reading the proxy's secret.
func (c ProxyConfig) Validate(listen string) error {
	_, _, err := c.parse(listen)
	return err
}

// parse checks c against the console's address and reads the proxy's
// secret; p is nil when c.Header is empty. The secret is what the header
// is believed on: a source address is not enough, even loopback, which
// kubectl port-forward and ssh -L (the ways operations.md gives to reach
// the console) arrive on, so that anyone who may port-forward would
// otherwise sign in as anyone.
func (c ProxyConfig) parse(listen string) (*ProxySignIn, UserMap, error) {
	if c.Header == "" {
		if c.Users != "" || c.From != "" || c.SecretFile != "" {
			return nil, UserMap{}, errors.New("--console-proxy-user, --console-proxy-secret-file and --console-proxy-from need --console-proxy-header")
		}
		return nil, UserMap{}, nil
	}
	var errs []error
	if listen == "" {
		errs = append(errs, errors.New("--console-proxy-header needs --console-listen"))
	}
	if h := http.CanonicalHeaderKey(c.Header); h == "Authorization" || h == "Cookie" || h == ProxySecretHeader || strings.ContainsAny(c.Header, " :") {
		errs = append(errs, fmt.Errorf("--console-proxy-header %q is not a header a proxy names its user in", c.Header))
	}
	users, err := ParseUserMap(splitList(c.Users))
	if err != nil {
		errs = append(errs, fmt.Errorf("--console-proxy-user: %w", err))
	}
	p := &ProxySignIn{Header: c.Header}
	if p.Secret, err = readProxySecret(c.SecretFile); err != nil {
		errs = append(errs, err)
	}
	for _, s := range splitList(c.From) {
		pr, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				errs = append(errs, fmt.Errorf("--console-proxy-from: %q is neither a CIDR nor an address", s))
				continue
			}
			pr = netip.PrefixFrom(a, a.BitLen())
		}
		p.Trusted = append(p.Trusted, pr.Masked())
	}
	return p, users, errors.Join(errs...)
}

// readProxySecret reads the proxy's secret from path, without the
// whitespace around it (a file written by echo ends in a newline, which a
// proxy's header value does not carry). Its errors never quote the file.
func readProxySecret(path string) ([]byte, error) {
	if path == "" {
		return nil, fmt.Errorf("--console-proxy-header needs --console-proxy-secret-file: a file holding the secret the proxy sends in %s, since a source address proves nothing (kubectl port-forward and ssh -L arrive on loopback, and anyone who may use them would sign in as anyone)", ProxySecretHeader)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--console-proxy-secret-file: %w", err)
	}
	secret := bytes.TrimSpace(b)
	if len(secret) < MinProxySecretSize {
		return nil, fmt.Errorf("--console-proxy-secret-file %s holds %d bytes: the proxy's secret must have at least %d (openssl rand -hex 32)", path, len(secret), MinProxySecretSize)
	}
	return secret, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// SignIns are the ways operators sign in to a console on listen, of a
// server whose identities current returns: by a bearer token (signIn, for
// Config.SignIn) when some identity has token hashes, through the proxy
// that c describes (proxy, for Config.Proxy) when c names a header, or
// both. A console nobody could sign in to, or a proxy whose users would
// map to no identity, is an error.
func SignIns(c ProxyConfig, listen string, current func() *access.Set) (signIn func(token string) (string, error), proxy *ProxySignIn, err error) {
	proxy, users, err := c.parse(listen)
	if err != nil {
		return nil, nil, err
	}
	set := current()
	switch {
	case proxy != nil && !set.Enforced():
		return nil, nil, errors.New("--console-proxy-header: the server has no identities (--config) for the proxy's users to map to")
	case set.Enforced() && !set.HasTokens() && proxy == nil:
		return nil, nil, errors.New("--console-listen: the identities of --config all authenticate by client certificate, which a browser's sign-in cannot present: sign operators in through a trusted proxy (--console-proxy-header, --console-proxy-user), or give their identities token_hashes (idemreg new-token)")
	case set.HasTokens():
		signIn = SignInWith(current)
	}
	if proxy != nil {
		proxy.Identity = ProxyIdentityWith(current, users)
	}
	return signIn, proxy, nil
}
