// Package sweepcmd is idemreg sweep, one pass of the retention sweeper over
// a store, for a cron job: what it prints, and the exit status that tells
// a pass that finished from one --max-duration stopped and one that failed.
package sweepcmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/retention"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

// Exit statuses of sweep; any other failure exits 2 like every command.
const (
	ExitFailed     = 1 // the store could not be swept (unreachable, errors, cancelled)
	ExitMaxReached = 3 // --max-duration ran out; expired records may be left
)

// Command binds the flags of sweep, one pass of the sweeper: for a
// cron job. It exits 0 when the pass finished (nothing expired was left at
// its last batch), 3 when --max-duration ran out first, 1 when the store
// failed, and prints what it did on stdout.
func Command(fs *flag.FlagSet) command.Run {
	cfg := config.Default()
	cfg.BindSweep(fs)
	return func(ctx context.Context, stdout, stderr io.Writer) error { return sweep(ctx, &cfg, stdout, stderr) }
}

func sweep(ctx context.Context, cfg *config.Config, stdout, stderr io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := cfg.ExistingStore(); err != nil {
		return err
	}
	logger := cfg.Logger(stderr)
	failed := func(format string, args ...any) error {
		return command.Exit(ExitFailed, fmt.Errorf(format, args...))
	}

	store, err := cfg.OpenStore(ctx, logger, nil)
	if errors.Is(err, pebble.ErrLocked) {
		return failed("%w: a running idemreg serve holds it, and sweeps it itself with --sweep-interval", err)
	}
	if err != nil {
		return failed("%w", err)
	}
	defer store.Close()
	sw, ok := store.(storage.Sweeper)
	if !ok {
		return failed("the store %T cannot sweep", store)
	}
	pctx, cancel := context.WithTimeout(ctx, config.PingTimeout)
	err = store.Ping(pctx)
	cancel()
	if err != nil {
		return failed("the store does not answer: %w", err)
	}
	if ttl, err := config.RowLevelTTL(ctx, store); err != nil {
		return failed("%w", err)
	} else if ttl {
		return failed("this database deletes expired records with CockroachDB's row-level TTL (idemreg migrate --cockroach-ttl), and has no expires_at index to sweep by")
	}

	sweeper, err := retention.New(sw, cfg.Sweeper(logger))
	if err != nil {
		return err
	}
	rc := sweeper.Config()
	logger.Info("sweeping", "batch_size", rc.BatchSize, "batch_timeout", rc.BatchTimeout,
		"pause", max(rc.Pause, 0), "max_duration", rc.MaxDuration)
	res, err := sweeper.Once(ctx)
	fmt.Fprintln(stdout, summary(res))
	switch {
	case err == nil:
		return nil
	case errors.Is(err, retention.ErrMaxDuration):
		return command.Exit(ExitMaxReached, fmt.Errorf("sweep did not finish: --max-duration %v ran out with expired records left; run it more often or longer", cfg.Sweep.MaxDuration))
	default:
		return failed("sweep did not finish: %w", err)
	}
}

// summary is the line sweep prints when it is done.
func summary(r retention.Result) string {
	s := fmt.Sprintf("sweep %s: deleted %d expired records in %d batches (%d failed) in %v (%.1f/s)",
		r.Stop, r.Deleted, r.Batches, r.Errors, r.Duration.Round(time.Millisecond), r.Rate())
	switch {
	case !r.HasOldest:
		return s + "; no record is left"
	case r.Lag() > 0:
		return s + fmt.Sprintf("; the oldest record left expired %v ago", r.Lag().Round(time.Millisecond))
	default:
		return s + fmt.Sprintf("; the next record expires at %s", r.Oldest.Format(time.RFC3339))
	}
}
