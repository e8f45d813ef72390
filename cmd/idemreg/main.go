// Command idemreg runs the idempotency-key registry.
//
//	idemreg serve     run the gRPC service
//	idemreg migrate   apply the SQL schema to --database-url
//	idemreg sweep     delete expired records once (for a cron job)
//	idemreg health    ask a server's health listener whether it is serving
//	idemreg admin     list, inspect, resolve or invalidate records on a running server
//	idemreg new-token make a bearer token and the hash the config file keeps
//
// The load generator is a command of its own, cmd/idemreg-bench, so that
// this binary links none of its baselines' clients.
//
// Every flag can also be set by an IDEMREG_* environment variable named
// after it (--database-url is IDEMREG_DATABASE_URL); flags win.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `idemreg: an idempotency-key registry

Usage:
  idemreg serve   [flags]   run the gRPC service
  idemreg migrate [flags]   apply the SQL schema to --database-url
  idemreg sweep   [flags]   delete expired records once and exit (for a cron job):
                            0 finished, 1 failed, 3 stopped by --max-duration
  idemreg health  [flags]   check a server's --health-listen (exit 0 when SERVING)
  idemreg new-token         print a new bearer token and its hash for --config
  idemreg admin   CMD       list, inspect, resolve or invalidate records on a running
                            server (idemreg admin help)

Run "idemreg <command> -h" for the flags of a command.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "idemreg:", err)
		var exit *exitError
		if errors.As(err, &exit) {
			os.Exit(exit.code)
		}
		os.Exit(2)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "serve":
		return serve(ctx, args[1:], stderr)
	case "migrate":
		return migrate(ctx, args[1:], stdout, stderr)
	case "sweep":
		return sweep(ctx, args[1:], stdout, stderr)
	case "health":
		return health(ctx, args[1:], stdout, stderr)
	case "new-token":
		return newToken(ctx, args[1:], stdout, stderr)
	case "admin":
		return admin(ctx, args[1:], stdout, stderr)
	case "bench":
		// Moved out, so that this binary links no Redis client; old
		// scripts and docs fail with where it went.
		return errors.New("bench is no longer an idemreg command: the load generator is its own, go run ./cmd/idemreg-bench (docs/benchmarks.md)")
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("unknown command %q", args[0])
	}
}
