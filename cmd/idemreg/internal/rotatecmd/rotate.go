// Package rotatecmd is idemreg rotate-claim-key, which adds a claim key
// generation to the store, and the bounds it keeps a rotation's windows
// within so that claims in use are not broken.
package rotatecmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/server/policy"
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

// rotationBounds refuses a rotation whose windows break claims in use,
// unless allowShort. An activation sooner than a replica's refresh lets
// one issue secrets under a key the others do not know yet, which they
// refuse. A grace shorter than the longest lease (--max-lease, or a
// consumer's lease.max in --config, whichever is longer) retires the old
// key while a claim taken under it, with a single lease and no Extend, may
// still be held, and its Complete is then refused. The floor is the
// longest lease and not max_lease_total (a day by default): that bound is
// a backstop for a holder stuck extending forever, and a grace of a day
// would keep a leaked key alive that long on every rotation; a consumer
// that extends its claims past its lease needs a --grace above its
// max_lease_total (docs/operations.md, "Rotating the claim key").
func rotationBounds(activate, grace, longest time.Duration, source string, allowShort bool) error {
	var errs []error
	if activate < 0 {
		errs = append(errs, fmt.Errorf("--activate-after must not be negative, got %s", policy.FormatDuration(activate)))
	}
	if grace <= 0 {
		errs = append(errs, fmt.Errorf("--grace must be positive, got %s", policy.FormatDuration(grace)))
	}
	if len(errs) > 0 || allowShort {
		return errors.Join(errs...)
	}
	if activate < server.DefaultClaimKeyRefresh {
		errs = append(errs, fmt.Errorf("--activate-after %s is shorter than serve's claim key refresh (%s): a replica that has not read the new key yet would refuse the secrets another issues under it; give at least %s (default %s), or --allow-short-rotation",
			policy.FormatDuration(activate), policy.FormatDuration(server.DefaultClaimKeyRefresh), policy.FormatDuration(server.DefaultClaimKeyRefresh), policy.FormatDuration(defaultActivateAfter)))
	}
	if grace < longest {
		errs = append(errs, fmt.Errorf("--grace %s is shorter than %s (%s): a claim taken before the activation could still be held when its key is retired, and its Complete would be refused (CLAIM_SECRET_INVALID); give at least %s (default %s), or --allow-short-rotation",
			policy.FormatDuration(grace), source, policy.FormatDuration(longest), policy.FormatDuration(longest), policy.FormatDuration(defaultRotationGrace)))
	}
	return errors.Join(errs...)
}

// Command binds the flags of rotate-claim-key, which adds a claim key
// generation to the store: "next" until --activate-after, then current,
// with the generation it replaces accepted for --grace after that.
func Command(fs *flag.FlagSet) command.Run {
	cfg := config.Default()
	activate, grace, allowShort := defaultActivateAfter, defaultRotationGrace, false
	l := &cfg.Server.Limits
	cmdline.Bind(fs, slices.Concat(cfg.StoreFlags(), cfg.LogFlags(), []cmdline.Flag{
		cmdline.Duration(&activate, "activate-after", "how long the new key is accepted but not issued under, so every replica reads it first: at least serve's claim key refresh ("+policy.FormatDuration(server.DefaultClaimKeyRefresh)+")"),
		cmdline.Duration(&grace, "grace", "how long the replaced key stays accepted once the new one is current: at least --max-lease, and the longest a claim is held (a consumer's max_lease_total, since Extend keeps the claim's secret) plus a page token's use"),
		cmdline.Duration(&l.MaxLease, "max-lease", "serve's --max-lease (read from the same $IDEMREG_MAX_LEASE): --grace must be at least this long"),
		cmdline.String(&cfg.PolicyFile, "config", "serve's config file (read from the same $IDEMREG_CONFIG), if any: --grace must also cover its consumers' longest lease.max"),
		cmdline.Bool(&allowShort, "allow-short-rotation", "allow --activate-after below serve's claim key refresh and --grace below the longest lease (--max-lease, lease.max in --config): claims held meanwhile may fail with CLAIM_SECRET_INVALID (a leaked key to retire at once)"),
	})...)
	return func(ctx context.Context, stdout, stderr io.Writer) error {
		if err := cfg.Validate(); err != nil {
			return err
		}
		longest, source := l.MaxLease, "--max-lease"
		if cfg.PolicyFile != "" {
			file, err := configfile.Load(cfg.PolicyFile, l.Policy())
			if err != nil {
				return err
			}
			if file.Policy.LongestLease() > longest {
				longest, source = file.Policy.LongestLease(), "the longest lease.max of --config"
			}
		}
		if err := rotationBounds(activate, grace, longest, source, allowShort); err != nil {
			return err
		}
		if err := cfg.ExistingStore(); err != nil {
			return err
		}
		logger := cfg.Logger(stderr)
		store, err := cfg.OpenStore(ctx, logger, nil)
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
