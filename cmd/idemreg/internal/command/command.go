// Package command is what one of idemreg's subcommands gives the binary's
// command table: a Func that binds its flags and returns what runs it, and
// an error that carries the process's exit status (Exit), so that a
// command in a package of its own decides its statuses and main exits
// with them.
package command

import (
	"context"
	"errors"
	"flag"
	"io"
)

// A Func binds a command's flags on fs and returns what runs it once they
// are parsed (environment first, then arguments: cmdline.Parse).
type Func func(fs *flag.FlagSet) Run

// Run runs a command, writing its answer on stdout and its logs on stderr.
type Run func(ctx context.Context, stdout, stderr io.Writer) error

// ExitError is an error that sets the process's exit status.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// Exit is err with the exit status code.
func Exit(code int, err error) error { return &ExitError{Code: code, Err: err} }

// Status is the exit status err sets, the outermost ExitError's, and false
// when none sets one (main exits 2 then).
func Status(err error) (int, bool) {
	var exit *ExitError
	if errors.As(err, &exit) {
		return exit.Code, true
	}
	return 0, false
}
