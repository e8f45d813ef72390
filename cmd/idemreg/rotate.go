package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

// Defaults of rotate-claim-key (docs/operations.md, "Rotating the claim
// key").
const (
	// defaultActivateAfter exceeds every server's claim key refresh
	// (server.DefaultClaimKeyRefresh) with room to spare: every replica
	// accepts the new key before any issues secrets under it.
	defaultActivateAfter = 4 * server.DefaultClaimKeyRefresh
	// defaultRotationGrace covers the longest lease (max lease, 1 h by
	// default) and a page token's use, with room to spare. A consumer whose
	// max_lease_total lets a claim be extended for longer needs more.
	defaultRotationGrace = 2 * time.Hour
)

// rotateCommand binds the flags of rotate-claim-key, which adds a claim key
// generation to the store: "next" until --activate-after, then current,
// with the generation it replaces accepted for --grace after that.
func rotateCommand(fs *flag.FlagSet) func(context.Context, io.Writer, io.Writer) error {
	cfg := defaultConfig()
	cfg.bindCommon(fs)
	var activate, grace time.Duration
	durationVar(fs, &activate, "activate-after", defaultActivateAfter, "how long the new key is accepted but not issued under, so every replica reads it first: more than serve's claim key refresh (30s)")
	durationVar(fs, &grace, "grace", defaultRotationGrace, "how long the replaced key stays accepted once the new one is current: at least the longest a claim is held (max lease, max_lease_total) plus a page token's use")
	return func(ctx context.Context, stdout, stderr io.Writer) error {
		if err := cfg.Validate(); err != nil {
			return err
		}
		if activate < 0 || grace <= 0 {
			return errors.New("--activate-after must not be negative and --grace must be positive")
		}
		if cfg.DatabaseURL == "" {
			// pebble.Open would create an empty store, with a key no
			// server ever used.
			if st, err := os.Stat(cfg.DataDir); err != nil || !st.IsDir() {
				return fmt.Errorf("no embedded store in --data-dir %s (give --database-url for PostgreSQL or CockroachDB)", cfg.DataDir)
			}
		}
		logger := cfg.logger(stderr)
		store, err := openStore(ctx, &cfg, logger, nil)
		if errors.Is(err, pebble.ErrLocked) {
			return fmt.Errorf("%w: stop the idemreg serve that holds it, rotate, and start it again (its claims stay valid for --grace)", err)
		}
		if err != nil {
			return err
		}
		defer store.Close()
		keys, ok := store.(storage.ClaimKeys)
		if !ok {
			return fmt.Errorf("the store %T keeps no claim keys", store)
		}
		ring, err := keys.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: activate, Grace: grace})
		if err != nil {
			return fmt.Errorf("rotating the claim key: %w", err)
		}
		// Generations and times only: never a key.
		next := ring.Keys[0]
		fmt.Fprintf(stdout, "claim key generation %d added: current from %s (store clock)\n", next.Generation, next.ActiveFrom.Format(time.RFC3339))
		for _, k := range ring.Keys[1:] {
			fmt.Fprintf(stdout, "generation %d accepted until %s\n", k.Generation, k.AcceptUntil.Format(time.RFC3339))
		}
		return nil
	}
}
