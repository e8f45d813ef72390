package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// startConsole serves the operator console on --console-listen until the
// returned function is called. The console calls the AdminService through
// srv's InProcess connection, which no network peer can open and which
// needs no TLS, so it works the same with --tls-cert and --tls-client-ca
// as without. It has no authority of its own: a call carries the bearer
// token the operator signed in with, or, for an operator a trusted proxy
// signed in (--console-proxy-header, with its secret), names the identity the proxy's user
// maps to (server.ActAs), so that the AdminService authorises and audits
// the operator's identity either way. Its status panel reads the
// sweeper's lag from store, when store can sweep; its resolve form knows
// the server's response types.
func startConsole(ctx context.Context, cfg *config, current func() *access.Set, types *resulttype.Types, srv *server.Server, store storage.Store, logger *slog.Logger) (stop func(), err error) {
	addr := cfg.ConsoleListen
	if addr == "" {
		return func() {}, nil
	}
	set := current()
	proxy, err := cfg.ConsoleProxy.signIn(addr, current)
	if err != nil {
		return nil, err
	}
	var signIn func(string) (string, error)
	switch {
	case proxy != nil && !set.Enforced():
		return nil, errors.New("--console-proxy-header: the server has no identities (--config) for the proxy's users to map to")
	case set.Enforced() && !set.HasTokens() && proxy == nil:
		return nil, errors.New("--console-listen: the identities of --config all authenticate by client certificate, which a browser's sign-in cannot present: sign operators in through a trusted proxy (--console-proxy-header, --console-proxy-user), or give their identities token_hashes (idemreg new-token)")
	case set.HasTokens():
		signIn = console.SignInWith(current)
	}
	sweepLag, err := consoleSweepLag(ctx, store)
	if err != nil {
		return nil, err
	}
	conn, err := srv.InProcess()
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	h, err := console.New(console.Config{Conn: conn, SignIn: signIn, Proxy: proxy, ActAs: server.ActAs,
		SweepLag: sweepLag, Types: types, Logger: logger.With("component", "console")})
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	stopHTTP, bound, err := httpserve.Serve("console", addr, h, cfg.HTTP, logger)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	logger.Info("serving console", "listen", bound.String(), "sign_in", signIn != nil, "proxy_header", cfg.ConsoleProxy.Header)
	return func() { stopHTTP(); _ = conn.Close() }, nil
}

// consoleProxyFlags are the flags of the console's sign-in by a trusted
// proxy's header.
type consoleProxyFlags struct {
	// Header names the proxy's header; empty turns proxy sign-in off, and
	// the header is then ignored.
	Header string
	// Users maps the header's users to identities: USER=IDENTITY,
	// comma-separated (console.ParseUserMap).
	Users string
	// SecretFile holds the secret the proxy sends in
	// console.ProxySecretHeader; required with Header.
	SecretFile string
	// From are the proxy's source addresses (CIDRs or addresses,
	// comma-separated), believed besides the secret; empty: any.
	From string
}

func (f *consoleProxyFlags) bind(fs *flag.FlagSet) {
	fs.StringVar(&f.Header, "console-proxy-header", f.Header, "sign console operators in from this header of a trusted reverse proxy (X-Forwarded-Email or X-Auth-Request-User of oauth2-proxy; an identity-aware proxy's user header), believed only with the proxy's secret (--console-proxy-secret-file); off when empty, and the header is then ignored")
	fs.StringVar(&f.Users, "console-proxy-user", f.Users, "USER=IDENTITY,... maps the proxy header's users to identities of --config (USER is exact, *@DOMAIN or *); needed with --console-proxy-header")
	fs.StringVar(&f.SecretFile, "console-proxy-secret-file", f.SecretFile, "file holding the secret (at least "+strconv.Itoa(console.MinProxySecretSize)+" bytes: openssl rand -hex 32) the proxy sends in its "+console.ProxySecretHeader+" header on every request; needed with --console-proxy-header, since a source address proves nothing (kubectl port-forward and ssh -L arrive on loopback); read at start")
	fs.StringVar(&f.From, "console-proxy-from", f.From, "the proxy's source addresses (CIDR or address, comma-separated): --console-proxy-header is refused from any other, the secret notwithstanding; empty: from any address that sends the secret")
}

func (f consoleProxyFlags) validate(listen string) error {
	_, _, _, err := f.parse(listen)
	return err
}

// parse checks the flags against the console's address and reads the
// proxy's secret. The secret is what the header is believed on: a source
// address is not enough, even loopback, which kubectl port-forward and
// ssh -L (the ways operations.md gives to reach the console) arrive on,
// so that anyone who may port-forward would otherwise sign in as anyone.
func (f consoleProxyFlags) parse(listen string) (console.UserMap, []byte, []netip.Prefix, error) {
	if f.Header == "" {
		if f.Users != "" || f.From != "" || f.SecretFile != "" {
			return console.UserMap{}, nil, nil, errors.New("--console-proxy-user, --console-proxy-secret-file and --console-proxy-from need --console-proxy-header")
		}
		return console.UserMap{}, nil, nil, nil
	}
	var errs []error
	if listen == "" {
		errs = append(errs, errors.New("--console-proxy-header needs --console-listen"))
	}
	if h := http.CanonicalHeaderKey(f.Header); h == "Authorization" || h == "Cookie" || h == console.ProxySecretHeader || strings.ContainsAny(f.Header, " :") {
		errs = append(errs, fmt.Errorf("--console-proxy-header %q is not a header a proxy names its user in", f.Header))
	}
	users, err := console.ParseUserMap(splitList(f.Users))
	if err != nil {
		errs = append(errs, fmt.Errorf("--console-proxy-user: %w", err))
	}
	secret, err := readProxySecret(f.SecretFile)
	if err != nil {
		errs = append(errs, err)
	}
	var from []netip.Prefix
	for _, s := range splitList(f.From) {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				errs = append(errs, fmt.Errorf("--console-proxy-from: %q is neither a CIDR nor an address", s))
				continue
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		from = append(from, p.Masked())
	}
	return users, secret, from, errors.Join(errs...)
}

// readProxySecret reads the proxy's secret from path, without the
// whitespace around it (a file written by echo ends in a newline, which a
// proxy's header value does not carry). Its errors never quote the file.
func readProxySecret(path string) ([]byte, error) {
	if path == "" {
		return nil, fmt.Errorf("--console-proxy-header needs --console-proxy-secret-file: a file holding the secret the proxy sends in %s, since a source address proves nothing (kubectl port-forward and ssh -L arrive on loopback, and anyone who may use them would sign in as anyone)", console.ProxySecretHeader)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--console-proxy-secret-file: %w", err)
	}
	secret := bytes.TrimSpace(b)
	if len(secret) < console.MinProxySecretSize {
		return nil, fmt.Errorf("--console-proxy-secret-file %s holds %d bytes: the proxy's secret must have at least %d (openssl rand -hex 32)", path, len(secret), console.MinProxySecretSize)
	}
	return secret, nil
}

// signIn is the console's ProxySignIn, nil when the header is not set.
func (f consoleProxyFlags) signIn(listen string, current func() *access.Set) (*console.ProxySignIn, error) {
	if f.Header == "" {
		return nil, nil
	}
	users, secret, from, err := f.parse(listen)
	if err != nil {
		return nil, err
	}
	return &console.ProxySignIn{Header: f.Header, Secret: secret, Trusted: from, Identity: console.ProxyIdentityWith(current, users)}, nil
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

// consoleSweepLag is the console's SweepLag for store: nil when the store
// cannot report its oldest expiry, or when CockroachDB's row-level TTL
// deletes expired records, as there is then no expires_at index and each
// look at the status panel would scan the table.
func consoleSweepLag(ctx context.Context, store storage.Store) (func(context.Context) (time.Duration, bool, error), error) {
	sw, ok := store.(storage.Sweeper)
	if !ok {
		return nil, nil
	}
	if ttl, err := rowLevelTTL(ctx, store); err != nil {
		return nil, fmt.Errorf("console: %w", err)
	} else if ttl {
		return nil, nil
	}
	return console.SweepLagFrom(sw), nil
}
