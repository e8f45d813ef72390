package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// spawned is a server started for one run.
type spawned struct {
	cmd   *exec.Cmd
	addr  string
	pprof string
	dir   string
	done  chan error
	// stopped is set by stop, so a second stop does nothing.
	stopped bool
}

func benchFreeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func spawnServer(ctx context.Context, cfg benchConfig, bt benchTarget, stderr io.Writer) (*spawned, error) {
	target := bt.Kind
	exe := cmp.Or(bt.ServerBinary, cfg.ServerBinary, cfg.builtServer)
	if target == "grpc-floor" {
		// The floor's server is this binary's hidden command.
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	addr, err := benchFreeAddr()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idemreg-bench-")
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--listen", addr, "--log-level", "warn", "--log-format", "text"}
	switch target {
	case "idemreg":
		args = append(args, "--database-url", cfg.DatabaseURL)
	case "idemreg-embedded":
		args = append(args, "--database-url", "", "--data-dir", filepath.Join(dir, "data"))
	case "grpc-floor":
		args = []string{floorServerCommand, "--listen", addr, "--static-window=" + strconv.Itoa(int(bt.StaticWindow))}
		args = append(args, bt.ServerArgs...) // only --static-window
	}
	s := &spawned{addr: addr, dir: dir, done: make(chan error, 1)}
	if cfg.ProfileDir != "" && target != "grpc-floor" {
		if s.pprof, err = benchFreeAddr(); err != nil {
			return nil, err
		}
		args = append(args, "--pprof-listen", s.pprof)
	}
	if target != "grpc-floor" {
		args = append(args, cfg.ServerFlags...)
		args = append(args, bt.ServerArgs...)
	}
	s.cmd = exec.CommandContext(ctx, exe, args...)
	s.cmd.Env = append(os.Environ(), bt.ServerEnv...)
	s.cmd.Stdout, s.cmd.Stderr = stderr, stderr
	if err := s.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	go func() { s.done <- s.cmd.Wait() }()
	if err := waitServing(ctx, addr, s.done); err != nil {
		s.stop()
		return nil, fmt.Errorf("server %s did not start: %w", strings.Join(args, " "), err)
	}
	return s, nil
}

func waitServing(ctx context.Context, addr string, exited <-chan error) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	h := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("exited: %v", err)
		default:
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		res, err := h.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("not SERVING after 30s")
}

func (s *spawned) stop() {
	if s.stopped {
		return
	}
	s.stopped = true
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	os.RemoveAll(s.dir)
}

// floorServerCommand is the hidden first argument that runs the
// grpc-floor target's server instead of the bench.
const floorServerCommand = "floor-server"

// floorServer serves grpc.health.v1 alone, on a grpc-go server with no
// options but the static windows that idemreg serve's --static-window
// sets (so that the floor stays a floor), until ctx ends.
func floorServer(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("idemreg-bench "+floorServerCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:0", "address to listen on")
	window := fs.Int("static-window", 0, "fix the HTTP/2 flow-control windows at this many bytes (0: grpc-go's dynamic windows)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var opts []grpc.ServerOption
	if *window > 0 {
		opts = append(opts, grpc.StaticStreamWindowSize(int32(*window)), grpc.StaticConnWindowSize(int32(*window)))
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, grpchealth.NewServer())
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	return srv.Serve(ln)
}

// serverPackage is what the bench builds when a server target names no
// binary: the production command of this module, so that the server
// measured is the code beside the bench, as when both were one binary.
const serverPackage = "github.com/idemreg/idemreg/cmd/idemreg"

// needsServerBinary says whether a target starts an idemreg server from
// neither --server-binary nor its own [@binary].
func needsServerBinary(cfg benchConfig) bool {
	if cfg.ServerBinary != "" || cfg.Addr != "" {
		return false
	}
	for _, t := range cfg.Targets {
		if (t.Kind == "idemreg" || t.Kind == "idemreg-embedded") && t.ServerBinary == "" {
			return true
		}
	}
	return false
}

// buildServer builds serverPackage to exe with the go command, in the
// working directory, which must be inside this module.
func buildServer(ctx context.Context, exe string, stderr io.Writer) error {
	args := []string{"build", "-o", exe, serverPackage}
	fmt.Fprintln(stderr, "idemreg-bench: building the server: go", strings.Join(args, " "))
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("building %s (run from the repository, or pass --server-binary): %w", serverPackage, err)
	}
	return nil
}
