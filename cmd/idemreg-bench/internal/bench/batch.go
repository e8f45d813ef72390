package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// BatchTarget is a Target that also claims and completes many keys in one
// call. In batch mode (Config.Batch) each iteration of a caller claims
// Config.Batch new keys in one call and completes the acquired ones in
// another; a pair is still one key claimed and completed, so pairs/s
// compares with the one-key-per-call targets.
type BatchTarget interface {
	Target
	// ClaimBatch claims keys and returns each one's outcome and fence;
	// errs[i] is item i's own failure. err is a failure of the whole call.
	ClaimBatch(ctx context.Context, keys []string) (outs []Outcome, fences []Fence, errs []error, err error)
	// CompleteBatch stores result for each key, fenced by its fence.
	CompleteBatch(ctx context.Context, keys []string, fences []Fence, result []byte) (errs []error, err error)
}

func (r *Registry) claimRequest(key string) *idemregv1.ClaimRequest {
	return &idemregv1.ClaimRequest{
		Consumer: r.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
		Lease: durationpb.New(Lease), Retention: durationpb.New(Retention), Holder: "bench",
	}
}

func (r *Registry) completeRequest(key string, f Fence, result []byte) *idemregv1.CompleteRequest {
	return &idemregv1.CompleteRequest{
		Consumer: r.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key, Token: f.Token, ClaimSecret: f.Secret,
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "bench.v1.Done", Data: result}}},
	}
}

// ClaimBatch implements BatchTarget with one BatchClaim.
func (r *Registry) ClaimBatch(ctx context.Context, keys []string) ([]Outcome, []Fence, []error, error) {
	req := &idemregv1.BatchClaimRequest{Requests: make([]*idemregv1.ClaimRequest, len(keys))}
	for i, k := range keys {
		req.Requests[i] = r.claimRequest(k)
	}
	res, err := r.client.BatchClaim(ctx, req)
	if err != nil {
		return nil, nil, nil, err
	}
	if n := len(res.GetResults()); n != len(keys) {
		return nil, nil, nil, fmt.Errorf("batch claim of %d keys answered %d results", len(keys), n)
	}
	outs, fences, errs := make([]Outcome, len(keys)), make([]Fence, len(keys)), make([]error, len(keys))
	for i, item := range res.GetResults() {
		if st := item.GetError(); st != nil {
			errs[i] = status.FromProto(st).Err()
			continue
		}
		c := item.GetResponse()
		outs[i], fences[i] = Outcome(c.GetOutcome()), Fence{Token: c.GetToken(), Secret: c.GetClaimSecret()}
	}
	return outs, fences, errs, nil
}

// CompleteBatch implements BatchTarget with one BatchComplete.
func (r *Registry) CompleteBatch(ctx context.Context, keys []string, fences []Fence, result []byte) ([]error, error) {
	req := &idemregv1.BatchCompleteRequest{Requests: make([]*idemregv1.CompleteRequest, len(keys))}
	for i, k := range keys {
		req.Requests[i] = r.completeRequest(k, fences[i], result)
	}
	res, err := r.client.BatchComplete(ctx, req)
	if err != nil {
		return nil, err
	}
	if n := len(res.GetResults()); n != len(keys) {
		return nil, fmt.Errorf("batch complete of %d keys answered %d results", len(keys), n)
	}
	errs := make([]error, len(keys))
	for i, item := range res.GetResults() {
		if st := item.GetError(); st != nil {
			errs[i] = status.FromProto(st).Err()
		}
	}
	return errs, nil
}

// newBatch is one batch-mode iteration: BatchClaim of cfg.Batch new keys,
// then BatchComplete of those acquired. Claim, Complete and Pair sample
// whole calls, one sample per batch; Ops and Pairs count items.
func (w *worker) newBatch(ctx context.Context, target BatchTarget, cfg Config, seq *atomic.Int64, measure bool) {
	keys := make([]string, cfg.Batch)
	for i := range keys {
		keys[i] = cfg.KeyPrefix + strconv.FormatInt(seq.Add(1), 10)
	}
	cctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	t0 := time.Now()
	outs, fences, errs, err := target.ClaimBatch(cctx, keys)
	t1 := time.Now()
	cancel()
	w.total += len(keys)
	if err != nil {
		if measure {
			w.ops += len(keys)
			w.fail(err, 0, 0)
		}
		return
	}
	var held []string
	var heldFences []Fence
	for i := range keys {
		switch {
		case errs[i] != nil:
			if measure {
				w.fail(errs[i], 0, 0)
			}
		case outs[i] != Acquired:
			if measure {
				w.fail(nil, outs[i], Acquired)
			}
		default:
			held, heldFences = append(held, keys[i]), append(heldFences, fences[i])
		}
	}
	if measure {
		w.ops += len(keys)
		w.claim = append(w.claim, t1.Sub(t0))
	}
	if len(held) == 0 {
		return
	}
	cctx, cancel = context.WithTimeout(ctx, cfg.Timeout)
	cerrs, err := target.CompleteBatch(cctx, held, heldFences, cfg.Result)
	t2 := time.Now()
	cancel()
	w.total += len(held)
	if !measure {
		return
	}
	w.ops += len(held)
	if err != nil {
		w.fail(err, 0, 0)
		return
	}
	w.complete = append(w.complete, t2.Sub(t1))
	w.pair = append(w.pair, t2.Sub(t0))
	for _, e := range cerrs {
		if e != nil {
			w.fail(e, 0, 0)
			continue
		}
		w.pairs++
	}
}

// WaitConfig is one waiter-latency measurement: Pairs holder/waiter pairs
// at a time, Samples in all.
type WaitConfig struct {
	Samples, Pairs int
	// Settle is how long the holder lets its waiter's Claim reach the
	// server and start waiting before it completes (default 50 ms). The
	// answer does not say whether a Claim waited: one that reached the
	// server only after the Complete replays at once and counts as woken,
	// with a time near zero. On a loaded machine, settle longer.
	Settle time.Duration
	// Wait is the waiter's Claim wait (default 5 s).
	Wait      time.Duration
	KeyPrefix string
	Result    []byte
}

// WaitResult is what a waiter-latency measurement found.
type WaitResult struct {
	// Wake is from the holder's Complete returning to its waiter's Claim
	// returning; negative when the waiter answered first (it was woken
	// before the Complete's answer reached the holder).
	Wake Summary
	// Woken counts the waiters that answered completed; NotWoken, those
	// that answered otherwise (their wait ran out, or they arrived after
	// the Complete: not sampled).
	Woken, NotWoken, Errors int
	FirstError              string
}

// WaitLatency measures how soon a waiting Claim answers after the Complete
// it waits for: a holder claims a new key through holder, a waiter claims
// it with a wait through waiter (the same server or another replica on
// the same store), and the holder completes it once the waiter waits.
func WaitLatency(ctx context.Context, holder, waiter *Registry, cfg WaitConfig) (WaitResult, error) {
	if cfg.Samples < 1 || cfg.Pairs < 1 {
		return WaitResult{}, errors.New("bench: waiters need samples and pairs")
	}
	if cfg.Settle <= 0 {
		cfg.Settle = 50 * time.Millisecond
	}
	if cfg.Wait <= 0 {
		cfg.Wait = 5 * time.Second
	}
	var (
		seq  atomic.Int64
		mu   sync.Mutex
		res  WaitResult
		wake []time.Duration
		wg   sync.WaitGroup
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		res.Errors++
		if res.FirstError == "" {
			res.FirstError = err.Error()
		}
	}
	for range cfg.Pairs {
		wg.Go(func() {
			for ctx.Err() == nil {
				n := seq.Add(1)
				if n > int64(cfg.Samples) {
					return
				}
				d, woken, err := waitOnce(ctx, holder, waiter, cfg, cfg.KeyPrefix+strconv.FormatInt(n, 10))
				mu.Lock()
				switch {
				case err != nil:
				case woken:
					res.Woken++
					wake = append(wake, d)
				default:
					res.NotWoken++
				}
				mu.Unlock()
				if err != nil {
					fail(err)
				}
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return WaitResult{}, err
	}
	res.Wake = Summarize(wake)
	return res, nil
}

func waitOnce(ctx context.Context, holder, waiter *Registry, cfg WaitConfig, key string) (time.Duration, bool, error) {
	cctx, cancel := context.WithTimeout(ctx, cfg.Wait+10*time.Second)
	defer cancel()
	out, f, err := holder.Claim(cctx, key)
	if err != nil {
		return 0, false, err
	}
	if out != Acquired {
		return 0, false, fmt.Errorf("holder's claim of a new key answered %v", out)
	}
	type answer struct {
		out Outcome
		at  time.Time
		err error
	}
	answered := make(chan answer, 1)
	go func() {
		req := waiter.claimRequest(key)
		req.Holder, req.Wait = "bench-waiter", durationpb.New(cfg.Wait)
		res, err := waiter.client.Claim(cctx, req)
		answered <- answer{Outcome(res.GetOutcome()), time.Now(), err}
	}()
	select {
	case a := <-answered: // answered before the Complete: not waiting
		if a.err != nil {
			return 0, false, a.err
		}
		return 0, false, holder.Complete(cctx, key, f, cfg.Result)
	case <-time.After(cfg.Settle):
	}
	if err := holder.Complete(cctx, key, f, cfg.Result); err != nil {
		return 0, false, err
	}
	done := time.Now()
	a := <-answered
	if a.err != nil {
		return 0, false, a.err
	}
	return a.at.Sub(done), a.out == Completed, nil
}
