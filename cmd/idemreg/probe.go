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

	"github.com/idemreg/idemreg/server/access"
)

// healthCommand binds the flags of health, which asks a server's plaintext
// health listener (--health-listen) whether a service is SERVING: the
// container image's HEALTHCHECK, which has no other tool. Exit status 0
// when serving, 1 otherwise.
func healthCommand(fs *flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	addr := fs.String("addr", "127.0.0.1:7351", "address of the server's --health-listen")
	service := fs.String("service", "", `health service name: "" (ready: the store answers), "liveness", or a service`)
	timeout := fs.Duration("timeout", 2*time.Second, "give up after this long")
	return func(ctx context.Context, stdout, _ io.Writer) error {
		conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		res, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: *service})
		if err != nil {
			return &exitError{code: 1, err: fmt.Errorf("health check of %s: %w", *addr, err)}
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

// versionCommand prints what the binary was built from, as the Go
// toolchain stamped it: the module's version, the VCS revision and its
// time (with "+modified" when the tree had changes), and the Go version.
func versionCommand(*flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	return func(_ context.Context, stdout, _ io.Writer) error {
		info, ok := debug.ReadBuildInfo()
		if !ok {
			return errors.New("version: the binary carries no build information")
		}
		fmt.Fprint(stdout, versionText(info))
		return nil
	}
}

// versionText is what version prints of info. A build outside a VCS
// checkout, or with -buildvcs=false, has no revision: "unknown".
func versionText(info *debug.BuildInfo) string {
	vcs := map[string]string{"vcs.revision": "unknown", "vcs.time": "unknown"}
	for _, s := range info.Settings {
		vcs[s.Key] = s.Value
	}
	revision := vcs["vcs.revision"]
	if vcs["vcs.modified"] == "true" {
		revision += "+modified"
	}
	return fmt.Sprintf("idemreg %s\nrevision: %s\ntime:     %s\ngo:       %s\n",
		info.Main.Version, revision, vcs["vcs.time"], info.GoVersion)
}
