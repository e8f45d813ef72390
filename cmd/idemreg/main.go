// Command idemreg runs the idempotency-key registry.
//
//	idemreg serve     run the gRPC service
//	idemreg migrate   apply the SQL schema to --database-url (migrate status: list it)
//	idemreg sweep     delete expired records once (for a cron job)
//	idemreg health    ask a server's health listener whether it is serving
//	idemreg admin     list, inspect, resolve or invalidate records on a running server
//	idemreg new-token make a bearer token and the hash the config file keeps
//	idemreg version   print the module version, VCS revision and Go version
//
// The load generator is a command of its own, cmd/idemreg-bench, so that
// this binary links none of its baselines' clients.
//
// Every flag can also be set by an IDEMREG_* environment variable named
// after it (--database-url is IDEMREG_DATABASE_URL), which -h shows; flags
// win.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/admincli"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/backupcmd"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/healthcmd"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/migratecmd"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/rotatecmd"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/sweepcmd"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/versioncmd"
)

const usage = `idemreg: an idempotency-key registry

Usage:
  idemreg serve   [flags]   run the gRPC service
  idemreg migrate [flags]   apply the SQL schema to --database-url, listing what it applied
  idemreg migrate status [flags]
                            list applied and pending migrations (exit 0 up to date, 3 pending)
  idemreg rotate-claim-key [flags]
                            add a claim key generation; the old one stays accepted for --grace
  idemreg sweep   [flags]   delete expired records once and exit (for a cron job):
                            0 finished, 1 failed, 3 stopped by --max-duration
  idemreg backup  --to DIR|-
                            copy a serving embedded store into a directory or a tar stream
  idemreg restore --from DIR|- --data-dir D
                            install a backup as a data directory, refusing an incomplete one
  idemreg health  [flags]   check a server's --health-listen (exit 0 when SERVING)
  idemreg new-token         print a new bearer token and its hash for --config
  idemreg admin   CMD       list, inspect, resolve or invalidate records on a running
                            server (idemreg admin help)
  idemreg version           print the module version, VCS revision and Go version

Run "idemreg <command> -h" for the flags of a command. Every flag can be
set by the IDEMREG_* environment variable its help names; a flag wins.
`

// commands is the command table: each command's name as run takes it
// (two words for a command of a command, as "migrate status"), what binds
// its flags and runs it, and its summary, at the top of its -h.
var commands = map[string]struct {
	run     command.Func
	summary string
}{
	"serve":            {serveCommand, "Run the gRPC service. Durations take a unit, and days: 90s, 1h30m, 7d, 1d12h."},
	"migrate":          {migratecmd.Migrate, "Apply the SQL schema to --database-url and list the migrations applied;\n\"idemreg migrate status\" lists those applied and those pending (exit 0\nwhen none is pending, " + strconv.Itoa(migratecmd.ExitPending) + " when some are)."},
	"migrate status":   {migratecmd.Status, "List the migrations --database-url has applied and those pending; change\nnothing. Exit 0 when none is pending, " + strconv.Itoa(migratecmd.ExitPending) + " when some are (for an init\ncontainer or a deploy check), 2 when the database cannot be read."},
	"rotate-claim-key": {rotatecmd.Command, "Add a claim key generation; the old one stays accepted for --grace."},
	"sweep":            {sweepcmd.Command, "Delete expired records once and exit: 0 finished, 1 failed, 3 stopped by --max-duration."},
	"backup":           {backupcmd.Backup, "Copy a serving embedded store into a directory or a tar stream (--to -): every\nfile checked against the server's manifest, BACKUP-COMPLETE written last."},
	"restore":          {backupcmd.Restore, "Install a backup as --data-dir, refusing an incomplete one, a non-empty\ndirectory without --force, and a directory a serve holds."},
	"health":           {healthcmd.Command, "Check a server's --health-listen: exit 0 when SERVING."},
	"new-token":        {newTokenCommand, "Print a new bearer token, for the client, and its hash, for token_hashes in\n--config. It takes no flags."},
	"version":          {versioncmd.Command(stamp()), "Print the module version, VCS revision and Go version."},
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

// stamp is what make build stamped, for versioncmd.
func stamp() versioncmd.Stamp {
	return versioncmd.Stamp{Version: version, Revision: revision, Time: revisionTime}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0) // asked for, and printed
		}
		if call := (*admincli.CallError)(nil); errors.As(err, &call) {
			fmt.Fprintln(os.Stderr, call.Error()) // "error: ..." and its details
		} else {
			fmt.Fprintln(os.Stderr, "idemreg:", err)
		}
		if code, ok := command.Status(err); ok {
			os.Exit(code)
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
	case "admin":
		return admin(ctx, args[1:], stdout, stderr)
	case "bench":
		// Moved out, so that this binary links no Redis client; old
		// scripts and docs fail with where it went.
		return errors.New("bench is no longer an idemreg command: the load generator is its own, go run ./cmd/idemreg-bench (docs/benchmarks.md)")
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	case "--version":
		args[0] = "version"
	}
	if len(args) > 1 {
		if cmd, ok := commands[args[0]+" "+args[1]]; ok {
			return runCommand(ctx, args[0]+" "+args[1], "[flags]", cmd.run, args[2:], stdout, stderr)
		}
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("unknown command %q", args[0])
	}
	return runCommand(ctx, args[0], "[flags]", cmd.run, args[1:], stdout, stderr)
}

// runCommand parses a command's flags from the environment and args, and
// runs it.
func runCommand(ctx context.Context, name, synopsis string, cmd command.Func, args []string, stdout, stderr io.Writer) error {
	fs, exec := flagSet(name, synopsis, stderr, cmd)
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %q", name, fs.Args())
	}
	return exec(ctx, stdout, stderr)
}

// flagSet makes the flag set of a command, binds its flags and names each
// flag's environment variable in its help.
func flagSet(name, synopsis string, stderr io.Writer, cmd command.Func) (*flag.FlagSet, command.Run) {
	name = "idemreg " + name
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		if !hasFlags(fs) {
			synopsis = strings.TrimSpace(strings.ReplaceAll(synopsis, "[flags]", ""))
		}
		fmt.Fprintf(stderr, "usage: %s\n", strings.TrimSpace(name+" "+synopsis))
		if s := commands[strings.TrimPrefix(name, "idemreg ")].summary; s != "" {
			fmt.Fprintf(stderr, "\n%s\n", s)
		}
		if hasFlags(fs) {
			fmt.Fprint(stderr, "\nflags (each also read from the environment variable shown; a flag given wins):\n")
			var table []cmdline.Flag // nil: in name order
			if name == "idemreg serve" {
				c := config.Default()
				table = c.ServeFlags()
			}
			cmdline.Print(stderr, fs, table)
		}
	}
	exec := cmd(fs)
	cmdline.NameEnv(fs)
	return fs, exec
}

func hasFlags(fs *flag.FlagSet) bool {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	return n > 0
}

// parse reads environment variables first, then flags, so flags win.
var parse = cmdline.Parse

// admin runs an admin command (admincli) against a running server.
func admin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stdout, admincli.Usage)
		if len(args) == 0 {
			return errors.New("no admin command given")
		}
		return nil
	}
	name := args[0]
	cmd, ok := admincli.Commands[name]
	if !ok {
		fmt.Fprint(stderr, admincli.Usage)
		return fmt.Errorf("unknown admin command %q", name)
	}
	return runCommand(ctx, "admin "+name, cmd.Synopsis, adminCommand(cmd), args[1:], stdout, stderr)
}

// adminCommand is an admin command as run runs commands: a call the server
// refused exits with status 1, flags that could not make one with 2.
func adminCommand(cmd admincli.Command) command.Func {
	return func(fs *flag.FlagSet) command.Run {
		exec := cmd.Bind(fs)
		return func(ctx context.Context, stdout, _ io.Writer) error {
			err := exec(ctx, stdout)
			if call := (*admincli.CallError)(nil); errors.As(err, &call) {
				return command.Exit(1, err)
			}
			return err
		}
	}
}
