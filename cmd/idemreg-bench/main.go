// Command idemreg-bench drives idemreg servers and hand-written baselines
// (an inbox table with pgx, Redis SET NX, a bare gRPC server) with the same
// load, back to back, and prints throughput, latency and CPU per call
// (docs/benchmarks.md). It is a command of its own so that the production
// binary links none of the baselines' clients: it starts `idemreg serve`
// as a separate process, which is what it measures.
//
//	go run ./cmd/idemreg-bench -h
//	go run ./cmd/idemreg-bench --soak 30m -h
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

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "idemreg-bench:", err)
		os.Exit(2)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == floorServerCommand { // not in the usage: the bench starts it
		return floorServer(ctx, args[1:], stderr)
	}
	if isSoak(args) {
		return soakCmd(ctx, args, stdout, stderr)
	}
	return benchCmd(ctx, args, stdout, stderr)
}
