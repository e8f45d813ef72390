package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/storage"
)

// startConsole serves the operator console on --console-listen until the
// returned function is called. The console calls the AdminService over a
// plaintext loopback connection to grpcAddr, serve's own listener, with the
// signed-in operator's bearer token: it has no authority of its own. Its
// status panel reads the sweeper's lag from store, when store can sweep;
// its resolve form knows the server's response types.
func startConsole(ctx context.Context, cfg *config, current func() *access.Set, types *resulttype.Types, grpcAddr net.Addr, store storage.Store, logger *slog.Logger) (stop func(), err error) {
	addr := cfg.ConsoleListen
	if addr == "" {
		return func() {}, nil
	}
	if cfg.TLS.CertFile != "" {
		// The loopback connection would need a client certificate under
		// mTLS, and the console would have to forward the operator's.
		return nil, errors.New("--console-listen does not work with --tls-cert yet: the console reaches the AdminService over a plaintext loopback connection")
	}
	set := current()
	var signIn func(string) (string, error)
	switch {
	case set.Enforced() && !set.HasTokens():
		return nil, errors.New("--console-listen: the identities of --config all authenticate by client certificate, which the console cannot forward yet; give the operators' identities token_hashes (idemreg new-token)")
	case set.Enforced():
		signIn = console.SignInWith(current)
	}
	sweepLag, err := consoleSweepLag(ctx, store)
	if err != nil {
		return nil, err
	}
	target, err := loopbackTarget(grpcAddr)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("console: connecting to %s: %w", target, err)
	}
	h, err := console.New(console.Config{Conn: conn, SignIn: signIn, SweepLag: sweepLag, Types: types, Logger: logger.With("component", "console")})
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	stopHTTP, bound, err := httpserve.Serve("console", addr, h, cfg.HTTP, logger)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	logger.Info("serving console", "listen", bound.String(), "sign_in", signIn != nil)
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
	if ttl, err := rowLevelTTL(ctx, store); err != nil {
		return nil, fmt.Errorf("console: %w", err)
	} else if ttl {
		return nil, nil
	}
	return console.SweepLagFrom(sw), nil
}

// loopbackTarget is the address that reaches a listener from this host: its
// own, with an unspecified host (0.0.0.0, ::) replaced by loopback.
func loopbackTarget(addr net.Addr) (string, error) {
	tcp, ok := addr.(*net.TCPAddr)
	if !ok {
		return "", fmt.Errorf("console: the gRPC listener %s is not TCP", addr)
	}
	ip := tcp.IP
	if ip == nil || ip.IsUnspecified() {
		ip = net.IPv4(127, 0, 0, 1)
		if tcp.IP != nil && tcp.IP.To4() == nil {
			ip = net.IPv6loopback
		}
	}
	return net.JoinHostPort(ip.String(), fmt.Sprint(tcp.Port)), nil
}
