package main

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"strings"
)

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
