package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
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
// signed in (console.SignIns), names the identity the proxy's user maps to
// (server.ActAs), so that the AdminService authorises and audits the
// operator's identity either way. Its status panel reads the
// sweeper's lag from store, when store can sweep; its resolve form knows
// the server's response types.
func startConsole(ctx context.Context, cfg *config.Config, current func() *access.Set, types *resulttype.Types, srv *server.Server, store storage.Store, logger *slog.Logger) (stop func(), err error) {
	addr := cfg.ConsoleListen
	if addr == "" {
		return func() {}, nil
	}
	signIn, proxy, err := console.SignIns(cfg.ConsoleProxy, addr, current)
	if err != nil {
		return nil, err
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

// consoleSweepLag is the console's SweepLag for store: nil when the store
// cannot report its oldest expiry, or when CockroachDB's row-level TTL
// deletes expired records, as there is then no expires_at index and each
// look at the status panel would scan the table.
func consoleSweepLag(ctx context.Context, store storage.Store) (func(context.Context) (time.Duration, bool, error), error) {
	sw, ok := store.(storage.Sweeper)
	if !ok {
		return nil, nil
	}
	if ttl, err := config.RowLevelTTL(ctx, store); err != nil {
		return nil, fmt.Errorf("console: %w", err)
	} else if ttl {
		return nil, nil
	}
	return console.SweepLagFrom(sw), nil
}
