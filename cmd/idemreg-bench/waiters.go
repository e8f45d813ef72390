package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg-bench/internal/bench"
	"github.com/idemreg/idemreg/server"
)

// waiterReport is one waiter-latency measurement.
type waiterReport struct {
	Target string
	// Replica is "same" (waiter and holder on one server) or "other" (two
	// servers on one database).
	Replica string
	bench.WaitResult
}

// benchWaiters measures woken waiters (--waiters) for each server target
// that is not a -batch one: through the server the holder completes on,
// and, for idemreg on --database-url, through a second server on the same
// database (replica "other"), which the first tells of the Complete
// (server/internal/peers); the servers re-check only every
// --waiter-recheck, so that a fast wake is the telling's.
func benchWaiters(ctx context.Context, cfg benchConfig, stdout, stderr io.Writer) ([]waiterReport, error) {
	if cfg.Waiters == 0 {
		return nil, nil
	}
	var out []waiterReport
	seen := map[string]bool{}
	for _, bt := range cfg.Targets {
		if bt.Batch || bt.Pipelined || (bt.Kind != "idemreg" && bt.Kind != "idemreg-embedded") || seen[bt.Label] {
			continue
		}
		seen[bt.Label] = true
		cases := []string{"same"}
		if bt.Kind == "idemreg" && cfg.Addr == "" {
			cases = append(cases, "other")
		}
		for _, replica := range cases {
			r, err := waitersOnce(ctx, cfg, bt, replica, stderr)
			if err != nil {
				return nil, fmt.Errorf("waiters on %s, %s replica: %w", bt.Label, replica, err)
			}
			out = append(out, r)
			fmt.Fprintf(stdout, "waiters %-16s %s replica: %d woken, %d not woken, %d errors; Complete's return to the waiter's answer ms p50/p95/p99/max %s\n",
				r.Target, r.Replica, r.Woken, r.NotWoken, r.Errors, r.Wake)
			if r.FirstError != "" {
				fmt.Fprintf(stdout, "    first error: %s\n", r.FirstError)
			}
		}
	}
	if len(out) > 0 {
		fmt.Fprintf(stdout, "(the servers ran with --wait-recheck %s: a waiter through another replica woken sooner was told by the replica the Complete went through; the default re-check is %s)\n",
			cfg.WaiterRecheck, server.DefaultWaitRecheck)
	}
	return out, nil
}

func waitersOnce(ctx context.Context, cfg benchConfig, bt benchTarget, replica string, stderr io.Writer) (waiterReport, error) {
	rep := waiterReport{Target: bt.Label, Replica: replica}
	addrs := []string{cfg.Addr}
	if cfg.Addr == "" {
		addrs = addrs[:0]
		n := 1
		if replica == "other" {
			n = 2
		}
		bt.ServerArgs = append(slices.Clone(bt.ServerArgs), "--wait-recheck", cfg.WaiterRecheck.String())
		for range n {
			srv, err := spawnServer(ctx, cfg, bt, stderr)
			if err != nil {
				return rep, err
			}
			defer srv.stop()
			addrs = append(addrs, srv.addr)
		}
		if n > 1 {
			// Let each read the other's heartbeat (every
			// server.DefaultHeartbeat): a replica tells only the live
			// members it knows of.
			time.Sleep(2*server.DefaultHeartbeat + server.DefaultHeartbeat/2)
		}
	}
	holder, err := bench.NewRegistry(addrs[0], "bench.waiters")
	if err != nil {
		return rep, err
	}
	defer holder.Close()
	waiter := holder
	if len(addrs) > 1 {
		if waiter, err = bench.NewRegistry(addrs[1], "bench.waiters"); err != nil {
			return rep, err
		}
		defer waiter.Close()
	}
	res, err := bench.WaitLatency(ctx, holder, waiter, bench.WaitConfig{
		Samples: cfg.Waiters, Pairs: cfg.WaiterPairs, Settle: cfg.WaiterSettle,
		KeyPrefix: fmt.Sprintf("waiter-%s-%d-", replica, time.Now().UnixNano()), Result: make([]byte, cfg.ResultBytes),
	})
	rep.WaitResult = res
	return rep, err
}
