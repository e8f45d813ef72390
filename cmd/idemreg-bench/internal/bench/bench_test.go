package bench

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// memTarget is a Target in memory with the registry's claim answers.
type memTarget struct {
	mu    sync.Mutex
	state map[string]Outcome
	calls int
}

func (m *memTarget) Claim(_ context.Context, key string) (Outcome, Fence, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	switch s := m.state[key]; s {
	case 0:
		m.state[key] = InProgress
		return Acquired, Fence{Token: 1}, nil
	default:
		return s, Fence{}, nil
	}
}

func (m *memTarget) Complete(_ context.Context, key string, _ Fence, _ []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.state[key] != InProgress {
		return errors.New("not in progress")
	}
	m.state[key] = Completed
	return nil
}

func (m *memTarget) Close() error { return nil }

func TestRunCountsEveryCall(t *testing.T) {
	target := &memTarget{state: map[string]Outcome{}}
	res, err := Run(t.Context(), target, Config{
		Callers: 8, Count: 2000, Mix: Mix{Replay: 10, Collide: 10}, KeyPrefix: "k-",
	})
	require.NoError(t, err)
	require.Zero(t, res.Errors, res.FirstError)
	require.Zero(t, res.Unexpected, res.FirstError)
	require.Equal(t, target.calls, res.TotalOps, "no warmup: every call was measured")
	require.Equal(t, res.Ops, res.TotalOps)
	require.Equal(t, res.Pairs, res.Pair.N)
	require.Equal(t, res.Pairs, res.Complete.N)
	require.Equal(t, 2*res.Pairs+res.Replay.N+res.Collide.N, res.Ops)
	require.Positive(t, res.Replay.N, "replays happen once keys are completed")
	require.LessOrEqual(t, res.Claim.P50, res.Claim.P99)
}

func TestRunReplaysPreloadedKeys(t *testing.T) {
	target := &memTarget{state: map[string]Outcome{}}
	for i := range 100 {
		target.state[PreloadKey(i)] = Completed
	}
	res, err := Run(t.Context(), target, Config{
		Callers: 4, Count: 500, Mix: Mix{Replay: 50}, ReplayKeys: 100, PreloadKey: PreloadKey,
	})
	require.NoError(t, err)
	require.Zero(t, res.Unexpected, res.FirstError)
	require.Positive(t, res.Replay.N)
}

func TestParseMix(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     Mix
		err      bool
	}{
		{name: "empty", in: ""},
		{name: "both", in: "replay=5,collide=7", want: Mix{Replay: 5, Collide: 7}},
		{name: "unknown", in: "delete=5", err: true},
		{name: "not a number", in: "replay=x", err: true},
		{name: "over 100", in: "replay=60,collide=50", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseMix(tc.in)
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestSummarize(t *testing.T) {
	var d []time.Duration
	for i := 100; i >= 1; i-- {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	s := Summarize(d)
	require.Equal(t, 100, s.N)
	require.Equal(t, 50*time.Millisecond, s.P50)
	require.Equal(t, 95*time.Millisecond, s.P95)
	require.Equal(t, 99*time.Millisecond, s.P99)
	require.Equal(t, 100*time.Millisecond, s.Max)
	require.Equal(t, Summary{}, Summarize(nil))
}

func TestWriteChartIsWellFormedSVG(t *testing.T) {
	var buf bytes.Buffer
	err := WriteChart(&buf, "title <&>", []Series{
		{Name: "idemreg", Points: []Point{{1, time.Millisecond, 3 * time.Millisecond, 800}, {64, 20 * time.Millisecond, 90 * time.Millisecond, 4000}}},
		{Name: "sql", Points: []Point{{1, 2 * time.Millisecond, 5 * time.Millisecond, 500}, {64, 30 * time.Millisecond, 200 * time.Millisecond, 2500}}},
	})
	require.NoError(t, err)
	dec := xml.NewDecoder(&buf)
	polylines := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			require.ErrorContains(t, err, "EOF")
			break
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
			polylines++
		}
	}
	require.Equal(t, 6, polylines, "p50, p99 and throughput per series")
}

// memBatchTarget is memTarget with batch calls; batches counts them.
type memBatchTarget struct {
	memTarget
	batches int
}

func (m *memBatchTarget) ClaimBatch(ctx context.Context, keys []string) ([]Outcome, []Fence, []error, error) {
	outs, fences, errs := make([]Outcome, len(keys)), make([]Fence, len(keys)), make([]error, len(keys))
	for i, k := range keys {
		outs[i], fences[i], errs[i] = m.Claim(ctx, k)
	}
	m.mu.Lock()
	m.batches++
	m.mu.Unlock()
	return outs, fences, errs, nil
}

func (m *memBatchTarget) CompleteBatch(ctx context.Context, keys []string, fences []Fence, result []byte) ([]error, error) {
	errs := make([]error, len(keys))
	for i, k := range keys {
		errs[i] = m.Complete(ctx, k, fences[i], result)
	}
	m.mu.Lock()
	m.batches++
	m.mu.Unlock()
	return errs, nil
}

func TestRunBatchMode(t *testing.T) {
	target := &memBatchTarget{memTarget: memTarget{state: map[string]Outcome{}}}
	res, err := Run(t.Context(), target, Config{Callers: 8, Count: 100, Batch: 64, KeyPrefix: "k-"})
	require.NoError(t, err)
	require.Zero(t, res.Errors, res.FirstError)
	require.Zero(t, res.Unexpected, res.FirstError)
	require.Equal(t, 64, res.Batch)
	require.Equal(t, 100*64, res.Pairs, "a pair is one key claimed and completed")
	require.Equal(t, 2*res.Pairs, res.Ops)
	require.Equal(t, target.calls, res.TotalOps, "every item counted")
	require.Equal(t, 200, target.batches, "one BatchClaim and one BatchComplete per iteration")
	require.Equal(t, 100, res.Pair.N, "one sample per batch")

	_, err = Run(t.Context(), &memTarget{state: map[string]Outcome{}}, Config{Callers: 1, Count: 1, Batch: 2})
	require.Error(t, err, "a target without batch calls")
}
