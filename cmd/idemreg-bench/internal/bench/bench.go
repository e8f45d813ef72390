// Package bench is the load generator behind `idemreg-bench`: N concurrent
// callers run a mix of claims of new keys (each followed by a Complete),
// duplicate claims of completed keys (replays) and claims of keys another
// caller holds (in-progress collisions) against a Target — the registry
// over gRPC, or a hand-written baseline on PostgreSQL or Redis — and it
// reports throughput and latency percentiles per operation.
//
// It measures; it decides nothing. Nothing here fails on a figure.
package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Outcome is what a claim answered, in the registry's terms.
type Outcome uint8

// Outcomes of a claim.
const (
	Acquired Outcome = iota + 1
	InProgress
	Completed
)

func (o Outcome) String() string {
	switch o {
	case Acquired:
		return "acquired"
	case InProgress:
		return "in_progress"
	case Completed:
		return "completed"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Fence is what a target's Complete needs from its Claim: a token, and the
// registry's claim secret.
type Fence struct {
	Token  int64
	Secret []byte
}

// Target is what the callers drive: the registry or a baseline. It is safe
// for concurrent use.
type Target interface {
	// Claim claims key and returns the outcome and, when acquired, what
	// fences the claim.
	Claim(ctx context.Context, key string) (Outcome, Fence, error)
	// Complete stores result for key, fenced by f where the target can.
	Complete(ctx context.Context, key string, f Fence, result []byte) error
	// Close releases the target's connections.
	Close() error
}

// Mix is the share of each kind of work, in percent of iterations; the
// rest after Replay and Collide are new keys.
type Mix struct {
	Replay  int // claim of a completed key: a duplicate delivery
	Collide int // claim of a key another caller holds right now
}

// ParseMix reads "replay=5,collide=5".
func ParseMix(s string) (Mix, error) {
	var m Mix
	if s == "" {
		return m, nil
	}
	for part := range strings.SplitSeq(s, ",") {
		name, val, ok := strings.Cut(part, "=")
		n, err := strconv.Atoi(val)
		if !ok || err != nil || n < 0 || n > 100 {
			return Mix{}, fmt.Errorf("mix: %q is not name=percent", part)
		}
		switch name {
		case "replay":
			m.Replay = n
		case "collide":
			m.Collide = n
		default:
			return Mix{}, fmt.Errorf("mix: unknown kind %q (replay, collide; the rest are new keys)", name)
		}
	}
	if m.Replay+m.Collide > 100 {
		return Mix{}, errors.New("mix: replay + collide exceed 100%")
	}
	return m, nil
}

func (m Mix) String() string {
	return fmt.Sprintf("new=%d,replay=%d,collide=%d", 100-m.Replay-m.Collide, m.Replay, m.Collide)
}

// Config is one run.
type Config struct {
	Callers  int
	Duration time.Duration // measured time; ignored when Count is set
	Count    int           // iterations to measure in all; 0 means Duration
	Warmup   time.Duration // unmeasured run before, to fill pools and caches
	Mix      Mix
	// KeyPrefix makes this run's keys unique: runs share databases.
	KeyPrefix string
	// ReplayKeys, when positive, makes replays claim a uniformly random key
	// PreloadKey(i) for i < ReplayKeys (completed records loaded before the
	// run) instead of a key this run completed.
	ReplayKeys int
	// PreloadKey names preloaded key i.
	PreloadKey func(i int) string
	Result     []byte
	// Timeout bounds each call.
	Timeout time.Duration
	// OnMeasure, when set, is called as the measured phase starts.
	OnMeasure func()
	// Batch, when positive, runs every iteration as a batch of this many
	// new keys (the target must be a BatchTarget; Mix is not used).
	Batch int
}

// Result is what a run measured.
type Result struct {
	Callers int
	Elapsed time.Duration
	Pairs   int // claims of new keys that acquired and completed
	Ops     int // every measured call: claims and completes
	// TotalOps counts the calls of the warmup too.
	TotalOps int
	Claim    Summary
	Replay   Summary // claims of completed keys
	Collide  Summary // claims of held keys
	Complete Summary
	Pair     Summary // claim + complete of a new key, end to end
	Errors   int
	// FirstError is the first error seen, for the report.
	FirstError string
	// Unexpected counts answers that contradict the mix (a new key not
	// acquired, a replay not completed): they are counted, not fatal.
	Unexpected int
	// Batch is the keys per call in batch mode (0: one key per call).
	// Claim, Complete and Pair then sample whole batch calls; Ops, TotalOps
	// and Pairs count keys.
	Batch int `json:",omitempty"`
}

// PairsPerSecond is the throughput of new-key claim+complete pairs.
func (r Result) PairsPerSecond() float64 { return float64(r.Pairs) / r.Elapsed.Seconds() }

// OpsPerSecond is the throughput of calls of every kind.
func (r Result) OpsPerSecond() float64 { return float64(r.Ops) / r.Elapsed.Seconds() }

// worker is one caller's state and samples.
type worker struct {
	rng                                 *rand.Rand
	claim, replay, collide, complete    []time.Duration
	pair                                []time.Duration
	pairs, ops, errs, unexpected, total int
	firstErr                            error
	held                                atomic.Pointer[string] // the key this caller holds, for collisions
	recent                              []string               // keys this caller completed, for replays
	recentNext                          int
}

const recentKeys = 256

// Run drives target with cfg.Callers callers and returns what it measured.
func Run(ctx context.Context, target Target, cfg Config) (Result, error) {
	if cfg.Callers < 1 {
		return Result{}, errors.New("bench: at least one caller")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	bt, batching := target.(BatchTarget)
	if cfg.Batch > 0 && !batching {
		return Result{}, errors.New("bench: this target has no batch calls")
	}
	batching = cfg.Batch > 0
	workers := make([]*worker, cfg.Callers)
	for i := range workers {
		workers[i] = &worker{rng: rand.New(rand.NewPCG(uint64(i)+1, uint64(time.Now().UnixNano())))}
	}
	var (
		seq       atomic.Int64
		measuring atomic.Bool
		stop      atomic.Bool
		remaining atomic.Int64
	)
	remaining.Store(int64(cfg.Count))
	iterate := func(w *worker) {
		measure := measuring.Load()
		if measure && cfg.Count > 0 && remaining.Add(-1) < 0 {
			stop.Store(true)
			return
		}
		if batching {
			w.newBatch(ctx, bt, cfg, &seq, measure)
			return
		}
		roll := w.rng.IntN(100)
		switch {
		case roll < cfg.Mix.Replay:
			if key, ok := replayKey(w, cfg); ok {
				w.claimOther(ctx, target, cfg, key, Completed, measure, &w.replay)
				return
			}
		case roll < cfg.Mix.Replay+cfg.Mix.Collide:
			other := workers[w.rng.IntN(len(workers))]
			if p := other.held.Load(); p != nil && other != w {
				w.claimOther(ctx, target, cfg, *p, InProgress, measure, &w.collide)
				return
			}
		}
		key := cfg.KeyPrefix + strconv.FormatInt(seq.Add(1), 10)
		w.newPair(ctx, target, cfg, key, measure)
	}

	if cfg.Warmup <= 0 {
		measuring.Store(true)
	}
	start := time.Now()
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Go(func() {
			for !stop.Load() && ctx.Err() == nil {
				iterate(w)
			}
		})
	}
	if cfg.Warmup > 0 {
		sleep(ctx, cfg.Warmup)
		measuring.Store(true)
		start = time.Now()
	}
	if cfg.OnMeasure != nil {
		cfg.OnMeasure()
	}
	if cfg.Count == 0 {
		sleep(ctx, cfg.Duration)
		stop.Store(true)
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}

	res := Result{Callers: cfg.Callers, Elapsed: elapsed, Batch: cfg.Batch}
	var claim, replay, collide, complete, pair []time.Duration
	for _, w := range workers {
		claim = append(claim, w.claim...)
		replay = append(replay, w.replay...)
		collide = append(collide, w.collide...)
		complete = append(complete, w.complete...)
		pair = append(pair, w.pair...)
		res.Pairs += w.pairs
		res.Ops += w.ops
		res.TotalOps += w.total
		res.Errors += w.errs
		res.Unexpected += w.unexpected
		if w.firstErr != nil && res.FirstError == "" {
			res.FirstError = w.firstErr.Error()
		}
	}
	res.Claim, res.Replay, res.Collide = Summarize(claim), Summarize(replay), Summarize(collide)
	res.Complete, res.Pair = Summarize(complete), Summarize(pair)
	return res, nil
}

func replayKey(w *worker, cfg Config) (string, bool) {
	if cfg.ReplayKeys > 0 && cfg.PreloadKey != nil {
		return cfg.PreloadKey(w.rng.IntN(cfg.ReplayKeys)), true
	}
	if len(w.recent) == 0 {
		return "", false
	}
	return w.recent[w.rng.IntN(len(w.recent))], true
}

func (w *worker) newPair(ctx context.Context, target Target, cfg Config, key string, measure bool) {
	cctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	t0 := time.Now()
	outcome, token, err := target.Claim(cctx, key)
	t1 := time.Now()
	cancel()
	w.total++
	if err != nil || outcome != Acquired {
		if measure {
			w.fail(err, outcome, Acquired)
		}
		return
	}
	// Others may collide with the key from now until it is completed.
	w.held.Store(&key)
	defer w.held.Store(nil)
	cctx, cancel = context.WithTimeout(ctx, cfg.Timeout)
	err = target.Complete(cctx, key, token, cfg.Result)
	t2 := time.Now()
	cancel()
	w.total++
	if !measure {
		return
	}
	w.ops += 2
	w.claim = append(w.claim, t1.Sub(t0))
	if err != nil {
		w.fail(err, 0, 0)
		return
	}
	w.complete = append(w.complete, t2.Sub(t1))
	w.pair = append(w.pair, t2.Sub(t0))
	w.pairs++
	if len(w.recent) < recentKeys {
		w.recent = append(w.recent, key)
	} else {
		w.recent[w.recentNext] = key
		w.recentNext = (w.recentNext + 1) % recentKeys
	}
}

func (w *worker) claimOther(ctx context.Context, target Target, cfg Config, key string, want Outcome, measure bool, into *[]time.Duration) {
	cctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	t0 := time.Now()
	outcome, _, err := target.Claim(cctx, key)
	d := time.Since(t0)
	cancel()
	w.total++
	if !measure {
		return
	}
	w.ops++
	if err != nil {
		w.fail(err, 0, 0)
		return
	}
	*into = append(*into, d)
	// A held key may have been completed meanwhile: both answers are right.
	if outcome != want && !(want == InProgress && outcome == Completed) {
		w.unexpected++
	}
}

func (w *worker) fail(err error, got, want Outcome) {
	if err == nil {
		w.unexpected++
		if w.firstErr == nil {
			w.firstErr = fmt.Errorf("claim of a new key answered %v, want %v", got, want)
		}
		return
	}
	w.errs++
	if w.firstErr == nil {
		w.firstErr = err
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
