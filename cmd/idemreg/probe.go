package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/server/access"
)

// healthCommand binds the flags of health, which asks a server's plaintext
// health listener (--health-listen) whether a service is SERVING: the
// container image's HEALTHCHECK, which has no other tool. Exit status 0
// when serving, 1 otherwise.
func healthCommand(fs *flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	addr, service, timeout := "127.0.0.1:7351", "", 2*time.Second
	cmdline.Bind(fs,
		cmdline.String(&addr, "addr", "address of the server's --health-listen"),
		cmdline.String(&service, "service", `health service name: "" (ready: the store answers), "liveness", or a service`),
		cmdline.Duration(&timeout, "timeout", "give up after this long"))
	return func(ctx context.Context, stdout, _ io.Writer) error {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		res, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			return &exitError{code: 1, err: fmt.Errorf("health check of %s: %w", addr, err)}
		}
		fmt.Fprintln(stdout, res.GetStatus())
		if res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return &exitError{code: 1, err: errors.New("not serving")}
		}
		return nil
	}
}

// newTokenCommand prints a fresh bearer token, for the client, and its
// hash, for token_hashes in the config file. Only the hash goes into the
// config.
func newTokenCommand(*flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	return func(_ context.Context, stdout, stderr io.Writer) error {
		var b [32]byte
		if _, err := rand.Read(b[:]); err != nil {
			return err
		}
		token := "idemreg_" + base64.RawURLEncoding.EncodeToString(b[:])
		fmt.Fprintf(stdout, "token: %s\nhash:  %s\n", token, access.HashToken(token))
		fmt.Fprintln(stderr, "Give the token to the client (authorization: bearer <token>); put the hash under token_hashes in --config.")
		return nil
	}
}

// version, revision and revisionTime are stamped by `make build`, which the
// Dockerfile runs too (-ldflags "-X main.version=... -X main.revision=...
// -X main.revisionTime=...": git describe, the commit and its time). A
// plain go build or go run leaves them empty, and version falls back to
// what the Go toolchain stamped: the module version and, in a git checkout
// built with -buildvcs (the default there), the VCS revision. The image is
// built without .git (.dockerignore), so without the flags it would say
// "unknown".
var (
	version      string
	revision     string
	revisionTime string
)

// versionCommand prints what the binary was built from: the version, the
// revision (with "+modified" when the toolchain saw a changed tree) and its
// time, and the Go version.
func versionCommand(*flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	return func(_ context.Context, stdout, _ io.Writer) error {
		info, ok := debug.ReadBuildInfo()
		if !ok {
			return errors.New("version: the binary carries no build information")
		}
		fmt.Fprint(stdout, versionText(info, stamp{version, revision, revisionTime}))
		return nil
	}
}

// stamp is what make build wrote into the binary with -ldflags -X.
type stamp struct{ version, revision, time string }

// versionText is what version prints of info and s: each of s's fields
// when set, else the toolchain's. A build with neither (outside a VCS
// checkout, or with -buildvcs=false, and not through make build) has no
// revision: "unknown".
func versionText(info *debug.BuildInfo, s stamp) string {
	vcs := map[string]string{"vcs.revision": "unknown", "vcs.time": "unknown"}
	for _, set := range info.Settings {
		vcs[set.Key] = set.Value
	}
	v, rev, when := info.Main.Version, vcs["vcs.revision"], vcs["vcs.time"]
	if vcs["vcs.modified"] == "true" {
		rev += "+modified"
	}
	if s.version != "" {
		v = s.version
	}
	if s.revision != "" {
		rev = s.revision
	}
	if s.time != "" {
		when = s.time
	}
	return fmt.Sprintf("idemreg %s\nrevision: %s\ntime:     %s\ngo:       %s\n", v, rev, when, info.GoVersion)
}
