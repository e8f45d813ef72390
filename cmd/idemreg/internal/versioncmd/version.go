// Package versioncmd is idemreg version, which prints what the binary was
// built from, and the build that the binary's telemetry and startup line
// name: what make build stamped into package main, else what the Go
// toolchain recorded.
package versioncmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/internal/telemetry"
)

// Stamp is what make build wrote into the binary with -ldflags -X (into
// package main's variables, which the Makefile names): git describe, the
// commit and its time. A plain go build or go run leaves it empty.
type Stamp struct{ Version, Revision, Time string }

// Command prints what the binary was built from: the version, the
// revision (with "+modified" when the toolchain saw a changed tree) and its
// time, and the Go version. It takes no flags.
func Command(s Stamp) command.Func {
	return func(*flag.FlagSet) command.Run {
		return func(_ context.Context, stdout, _ io.Writer) error {
			info, ok := debug.ReadBuildInfo()
			if !ok {
				return errors.New("version: the binary carries no build information")
			}
			fmt.Fprint(stdout, Text(info, s))
			return nil
		}
	}
}

// Text is what version prints of info and s: each of s's fields when set,
// else the toolchain's. A build with neither (outside a VCS checkout, or
// with -buildvcs=false, and not through make build) has no revision:
// "unknown".
func Text(info *debug.BuildInfo, s Stamp) string {
	vcs := map[string]string{"vcs.revision": "unknown", "vcs.time": "unknown"}
	for _, set := range info.Settings {
		vcs[set.Key] = set.Value
	}
	v, rev, when := info.Main.Version, vcs["vcs.revision"], vcs["vcs.time"]
	if vcs["vcs.modified"] == "true" {
		rev += "+modified"
	}
	if s.Version != "" {
		v = s.Version
	}
	if s.Revision != "" {
		rev = s.Revision
	}
	if s.Time != "" {
		when = s.Time
	}
	return fmt.Sprintf("idemreg %s\nrevision: %s\ntime:     %s\ngo:       %s\n", v, rev, when, info.GoVersion)
}

// Served is the build that idemreg_build_info, service.version and serve's
// startup line name: s's version and revision where make build stamped
// them, the toolchain's record otherwise.
func Served(s Stamp) telemetry.Build {
	b := telemetry.ReadBuild()
	if s.Version != "" {
		b.Version = s.Version
	}
	if s.Revision != "" {
		b.Revision = s.Revision
	}
	return b
}
