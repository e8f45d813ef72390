package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"time"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/cmd/idemreg-bench/internal/bench"
)

// benchRun is one run's figures.
type benchRun struct {
	bench.Result
	// DBCommits is the database's committed transactions during the run
	// (warmup included) per call, or -1 when not measured.
	CommitsPerCall float64
	// PeakRSS is the server's peak resident set in bytes, 0 when unknown.
	PeakRSS int64
	// ServerCPUPerCall and DBCPUPerCall are the CPU time the server process
	// and the database sessions of the target spent per measured call, in
	// microseconds, or -1 when not measured. On a shared machine they say
	// more than throughput does: they do not depend on who else runs.
	ServerCPUPerCall, DBCPUPerCall float64
	// ClientCPUPerCall is this process's CPU time per measured call: the
	// load generator and the target's client (gRPC, pgx or go-redis).
	ClientCPUPerCall float64
}

func benchOnce(ctx context.Context, cfg benchConfig, bt benchTarget, callers, rep int, stderr io.Writer) (benchRun, error) {
	run := benchRun{CommitsPerCall: -1, ServerCPUPerCall: -1, DBCPUPerCall: -1}
	target := bt.Kind
	runID := fmt.Sprintf("%s-%d-%d-%d", target, callers, rep, time.Now().UnixNano())
	// Round trips are counted as the database's commits, which its
	// statistics show once the sessions that made them have ended: so only
	// for the sessions this run opens and closes (a server started for it,
	// the sql baseline's pool).
	countsURL := ""
	if (target == "idemreg" && cfg.Addr == "") || target == "sql" {
		countsURL = cfg.DatabaseURL
	}
	var commits0 int64
	if countsURL != "" {
		var err error
		if commits0, err = bench.DBCommits(ctx, countsURL); err != nil {
			return run, err
		}
	}

	var (
		t   bench.Target
		srv *spawned
		pid int
		err error
	)
	switch target {
	case "grpc-floor":
		srv, err = spawnServer(ctx, cfg, bt, stderr)
		if err != nil {
			return run, err
		}
		defer srv.stop()
		pid = srv.cmd.Process.Pid
		t, err = bench.NewFloor(srv.addr, bench.StaticWindow(bt.StaticWindow)...)
	case "idemreg", "idemreg-embedded":
		addr := cfg.Addr
		pid = cfg.ServerPID
		if addr == "" {
			srv, err = spawnServer(ctx, cfg, bt, stderr)
			if err != nil {
				return run, err
			}
			defer srv.stop() // when returning early; stop is idempotent
			addr, pid = srv.addr, srv.cmd.Process.Pid
		}
		// Preloaded records belong to PreloadConsumer: replays claim them.
		switch {
		case bt.Pipelined:
			t, err = bench.NewRegistryPipelined(addr, bench.PreloadConsumer, bench.StaticWindow(bt.StaticWindow)...)
		case bt.Unary || bt.Batch:
			t, err = bench.NewRegistry(addr, bench.PreloadConsumer, bench.StaticWindow(bt.StaticWindow)...)
		default:
			t, err = bench.NewRegistryClient(addr, bench.PreloadConsumer, client.Batching{MaxInFlight: bt.ClientInFlight}, bench.StaticWindow(bt.StaticWindow)...)
		}
	case "sql":
		if bt.Pipelined {
			t, err = bench.NewSQLPipelined(ctx, cfg.DatabaseURL, "bench.sql", callers)
		} else {
			t, err = bench.NewSQLInbox(ctx, cfg.DatabaseURL, "bench.sql", callers)
		}
	case "redis":
		var r *bench.Redis
		r, err = bench.NewRedis(ctx, cfg.RedisAddr, "bench.redis."+runID, callers)
		if err == nil {
			defer func() { _ = r.Cleanup(context.WithoutCancel(ctx)) }()
		}
		t = r
	}
	if err != nil {
		return run, err
	}
	defer t.Close()

	bc := bench.Config{
		Callers: callers, Duration: cfg.Duration, Count: cfg.Count, Warmup: cfg.Warmup, Mix: cfg.Mix,
		KeyPrefix: runID + "-", Result: make([]byte, cfg.ResultBytes),
	}
	if target == "grpc-floor" {
		bc.Mix = bench.Mix{} // it knows no outcomes
	}
	if bt.Batch {
		bc.Batch, bc.Mix = cfg.Batch, bench.Mix{}
	}
	if bt.Pipelined {
		// A consumer loop on new keys (issue 37): a replay of a key whose
		// Complete is still held would find it in progress.
		bc.Mix = bench.Mix{}
	}
	if cfg.Preload > 0 && target == "idemreg" {
		bc.ReplayKeys, bc.PreloadKey = cfg.Preload, bench.PreloadKey
	}
	var profileDone chan error
	if srv != nil && srv.pprof != "" && cfg.ProfileDir != "" {
		profileDone = make(chan error, 1)
	}
	dbApp := ""
	switch {
	case target == "sql":
		dbApp = bench.SQLApplicationName
	case target == "idemreg" && cfg.Addr == "":
		dbApp = "idemreg"
	}
	var serverCPU0, dbCPU0, clientCPU0 time.Duration
	var dbPIDs []int
	var clientProfile *os.File
	bc.OnMeasure = func() {
		if cfg.ProfileDir != "" {
			// The caller side too: the stub or the client package, and the
			// driver's own work, in this process.
			clientProfile = startClientProfile(cfg.ProfileDir, bt.Label, callers, rep, stderr)
		}
		if profileDone != nil {
			path := filepath.Join(cfg.ProfileDir, fmt.Sprintf("cpu-%s-%d-%d.pprof", fileSafe(bt.Label), callers, rep))
			go func() { profileDone <- fetchProfile(ctx, srv.pprof, cfg.Duration, path) }()
		}
		serverCPU0 = processCPU(pid)
		clientCPU0 = selfCPU()
		if dbApp != "" {
			dbPIDs, _ = bench.BackendPIDs(ctx, cfg.DatabaseURL, dbApp)
			for _, p := range dbPIDs {
				dbCPU0 += processCPU(p)
			}
		}
	}
	res, err := bench.Run(ctx, t, bc)
	if err != nil {
		return run, err
	}
	run.Result = res
	if clientProfile != nil {
		pprof.StopCPUProfile()
		_ = clientProfile.Close()
	}
	if res.Ops > 0 {
		run.ClientCPUPerCall = float64((selfCPU() - clientCPU0).Microseconds()) / float64(res.Ops)
	}
	if pid > 0 && res.Ops > 0 {
		run.ServerCPUPerCall = float64((processCPU(pid) - serverCPU0).Microseconds()) / float64(res.Ops)
	}
	if len(dbPIDs) > 0 && res.Ops > 0 {
		var dbCPU time.Duration
		for _, p := range dbPIDs {
			dbCPU += processCPU(p)
		}
		run.DBCPUPerCall = float64((dbCPU - dbCPU0).Microseconds()) / float64(res.Ops)
	}
	if profileDone != nil {
		if err := <-profileDone; err != nil {
			fmt.Fprintln(stderr, "bench: profile:", err)
		}
	}
	run.PeakRSS = peakRSS(pid)
	_ = t.Close()
	if srv != nil {
		srv.stop()
	}
	if countsURL != "" {
		// A session flushes its statistics as it exits, a moment after
		// its connection closed.
		time.Sleep(500 * time.Millisecond)
		commits1, err := bench.DBCommits(ctx, countsURL)
		if err != nil {
			return run, err
		}
		if res.TotalOps > 0 {
			run.CommitsPerCall = float64(commits1-commits0) / float64(res.TotalOps)
		}
	}
	return run, nil
}
