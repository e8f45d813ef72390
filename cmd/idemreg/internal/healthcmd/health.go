// Package healthcmd is idemreg health, which asks a server's plaintext
// health listener (--health-listen) whether a service is SERVING: the
// container image's HEALTHCHECK, which has no other tool.
package healthcmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
)

// ExitNotServing is health's exit status when the service is not SERVING
// or the check failed.
const ExitNotServing = 1

// Command binds the flags of health. It exits 0 when the service is
// serving, ExitNotServing otherwise.
func Command(fs *flag.FlagSet) command.Run {
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
			return command.Exit(ExitNotServing, fmt.Errorf("health check of %s: %w", addr, err))
		}
		fmt.Fprintln(stdout, res.GetStatus())
		if res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return command.Exit(ExitNotServing, errors.New("not serving"))
		}
		return nil
	}
}
