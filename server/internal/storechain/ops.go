package storechain

import (
	"context"
	"time"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/storage"
)

// Claim implements storage.Store through do, and counts the Claim by
// outcome (idemreg.claims); Complete, Release, Extend and Park count their
// successes likewise.
func (c *Chain) Claim(ctx context.Context, p storage.ClaimParams) (res storage.ClaimResult, err error) {
	err = c.do(ctx, opClaim, func(ctx context.Context) error {
		res, err = c.b.Claim(ctx, p)
		return err
	})
	c.countClaim(ctx, res, err)
	return res, err
}

func (c *Chain) countClaim(ctx context.Context, res storage.ClaimResult, err error) {
	var outcome string
	switch {
	case reason.Classify(err) == idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH:
		outcome = ClaimMismatch
	case err != nil:
		return
	case res.Repeated:
		outcome = ClaimRepeat
	case res.Outcome == storage.OutcomeAcquired && res.Record.Attempt > 1:
		outcome = ClaimTakeover
	case res.Outcome == storage.OutcomeAcquired:
		outcome = ClaimAcquired
	case res.Outcome == storage.OutcomeInProgress:
		outcome = ClaimInProgress
	case res.Outcome == storage.OutcomeCompleted:
		outcome = ClaimReplay
	case res.Outcome == storage.OutcomeParked:
		outcome = ClaimParked
	}
	c.m.claims.Add(ctx, 1, claimOutcomes[outcome])
}

// ClaimBatch implements storage.Batcher: a batch is one operation in
// flight, and each item counts as a Claim.
func (c *Chain) ClaimBatch(ctx context.Context, ps []storage.ClaimParams) []storage.ClaimAnswer {
	out, ran := batch(c, ctx, opClaimBatch, len(ps), func(ctx context.Context) []storage.ClaimAnswer { return c.b.ClaimBatch(ctx, ps) },
		func(a *storage.ClaimAnswer) *error { return &a.Err })
	if !ran {
		return out
	}
	for _, a := range out {
		c.countClaim(ctx, a.Result, a.Err)
	}
	return out
}

// CompleteBatch implements storage.Batcher like ClaimBatch.
func (c *Chain) CompleteBatch(ctx context.Context, ps []storage.CompleteParams) []storage.CompleteAnswer {
	out, ran := batch(c, ctx, opCompleteBatch, len(ps), func(ctx context.Context) []storage.CompleteAnswer { return c.b.CompleteBatch(ctx, ps) },
		func(a *storage.CompleteAnswer) *error { return &a.Err })
	if !ran {
		return out
	}
	for _, a := range out {
		c.countComplete(ctx, a.Err)
	}
	return out
}

// Batch implements storage.MixedBatcher: a mixed batch is one operation
// in flight ("batch"), each Claim item counts as a Claim and each Complete
// item as a Complete, its LEASE_LOST as complete's.
func (c *Chain) Batch(ctx context.Context, ops []storage.Op) []storage.OpAnswer {
	out, ran := batch(c, ctx, opBatch, len(ops), func(ctx context.Context) []storage.OpAnswer { return c.b.Batch(ctx, ops) },
		func(a *storage.OpAnswer) *error { return &a.Err })
	if !ran {
		return out
	}
	for i, a := range out {
		if ops[i].Claim != nil {
			c.countClaim(ctx, a.Claim, a.Err)
			continue
		}
		c.countComplete(ctx, a.Err)
	}
	return out
}

// countComplete counts a batched Complete's answer as a Complete's.
func (c *Chain) countComplete(ctx context.Context, err error) {
	switch {
	case err == nil:
		c.m.completes.Add(ctx, 1)
	case reason.Classify(err) == idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST:
		c.m.leaseLost.Add(ctx, 1, opComplete.method)
	}
}

func (c *Chain) Complete(ctx context.Context, p storage.CompleteParams) (rec storage.Record, err error) {
	err = c.do(ctx, opComplete, func(ctx context.Context) error {
		rec, err = c.b.Complete(ctx, p)
		return err
	})
	if err == nil {
		c.m.completes.Add(ctx, 1)
	}
	return rec, err
}

func (c *Chain) Release(ctx context.Context, p storage.ReleaseParams) (rec storage.Record, err error) {
	err = c.do(ctx, opRelease, func(ctx context.Context) error {
		rec, err = c.b.Release(ctx, p)
		return err
	})
	if err == nil {
		c.m.releases.Add(ctx, 1)
	}
	return rec, err
}

func (c *Chain) Extend(ctx context.Context, p storage.ExtendParams) (rec storage.Record, err error) {
	err = c.do(ctx, opExtend, func(ctx context.Context) error {
		rec, err = c.b.Extend(ctx, p)
		return err
	})
	if err == nil {
		c.m.extends.Add(ctx, 1)
	}
	return rec, err
}

func (c *Chain) Park(ctx context.Context, p storage.ParkParams) (rec storage.Record, err error) {
	err = c.do(ctx, opPark, func(ctx context.Context) error {
		rec, err = c.b.Park(ctx, p)
		return err
	})
	if err == nil {
		c.m.parks.Add(ctx, 1)
	}
	return rec, err
}

func (c *Chain) Lookup(ctx context.Context, k storage.Key) (rec storage.Record, err error) {
	err = c.do(ctx, opLookup, func(ctx context.Context) error {
		rec, err = c.b.Lookup(ctx, k)
		return err
	})
	return rec, err
}

func (c *Chain) Inspect(ctx context.Context, k storage.Key) (res storage.InspectResult, err error) {
	err = c.do(ctx, opInspect, func(ctx context.Context) error {
		res, err = c.b.Inspect(ctx, k)
		return err
	})
	return res, err
}

func (c *Chain) Invalidate(ctx context.Context, p storage.InvalidateParams) (rec storage.Record, err error) {
	err = c.do(ctx, opInvalidate, func(ctx context.Context) error {
		rec, err = c.b.Invalidate(ctx, p)
		return err
	})
	return rec, err
}

func (c *Chain) Resolve(ctx context.Context, p storage.ResolveParams) (rec storage.Record, err error) {
	err = c.do(ctx, opResolve, func(ctx context.Context) error {
		rec, err = c.b.Resolve(ctx, p)
		return err
	})
	return rec, err
}

func (c *Chain) List(ctx context.Context, p storage.ListParams) (res storage.ListResult, err error) {
	err = c.do(ctx, opList, func(ctx context.Context) error {
		res, err = c.b.List(ctx, p)
		return err
	})
	return res, err
}

func (c *Chain) CountParked(ctx context.Context, prefix string) (counts map[string]int64, err error) {
	err = c.do(ctx, opCountParked, func(ctx context.Context) error {
		counts, err = c.b.CountParked(ctx, prefix)
		return err
	})
	return counts, err
}

// Passed through.

func (c *Chain) Ping(ctx context.Context) error { return c.b.Ping(ctx) }
func (c *Chain) Close() error                   { return c.b.Close() }
func (c *Chain) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	return c.b.ClaimKeyRing(ctx)
}

func (c *Chain) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	return c.b.RotateClaimKey(ctx, p)
}

func (c *Chain) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	return c.b.ConsumerUsage(ctx, consumers)
}

func (c *Chain) SweepExpired(ctx context.Context, limit int) (storage.SweepResult, error) {
	return c.b.SweepExpired(ctx, limit)
}

func (c *Chain) OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error) {
	return c.b.OldestExpiry(ctx)
}

// batch runs one batch of n items as one operation in flight (op): the
// store's answers, each item's error its own; when an item's error is the
// store failing (not an answer), the operation is measured and counted
// for readiness as failed. A batch refused before the store (the chain's
// own bounds) has that refusal as every item's answer, records no batch
// size, and is reported with ran false: its items count as nothing.
func batch[A any](c *Chain, ctx context.Context, op *opMeasures, n int, run func(context.Context) []A, errOf func(*A) *error) (out []A, ran bool) {
	err := c.do(ctx, op, func(ctx context.Context) error {
		ran = true
		out = run(ctx)
		for i := range out {
			if e := *errOf(&out[i]); e != nil && !reason.IsAnswer(reason.Classify(e)) {
				return e // the store failed: measured, and counted for readiness
			}
		}
		return nil
	})
	if !ran {
		out = make([]A, n)
		for i := range out {
			*errOf(&out[i]) = err
		}
		return out, false
	}
	c.m.batchSize.Record(ctx, int64(n), op.method)
	return out, true
}
