package quota_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/storagetest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func open(t *testing.T) *pebble.Store {
	s, err := pebble.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func claimParams(consumer, key string) storage.ClaimParams {
	return storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: key},
		Lease: time.Minute, Retention: time.Hour, Holder: "h"}
}

// claim runs a Claim through q and the store as the server does: Admit,
// the store's decision, Claimed.
func claim(t *testing.T, q *quota.Quotas, s storage.Store, owner string, pol policy.Policy, p storage.ClaimParams) error {
	t.Helper()
	r, err := q.Admit(context.Background(), s, owner, pol, p)
	if err != nil {
		return err
	}
	res, err := s.Claim(context.Background(), p)
	q.Claimed(r, res, err)
	return err
}

// TestMaxRecords: a consumer at max_records gets its new keys refused with
// Exceeded, its live keys still admitted; a record that expires makes room
// once a refresh counts it gone.
func TestMaxRecords(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	pol := policy.Policy{MaxRecords: 2, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	q.WithoutWake()
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "a")))
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "b")))
	err := claim(t, q, s, "id", pol, claimParams("c", "c"))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, err, &exceeded)
	assert.Equal(t, quota.Exceeded{Consumer: "c", Source: "test", MaxRecords: 2, Records: 2}, *exceeded)
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "a")), "a live key is admitted at the quota")
	records, _, ok := q.Usage("c")
	require.True(t, ok)
	assert.EqualValues(t, 2, records)

	require.NoError(t, q.Refresh(ctx))
	records, _, _ = q.Usage("c")
	assert.EqualValues(t, 2, records, "the store's count agrees")
	done, failed, running := q.Stats()
	assert.EqualValues(t, 1, done)
	assert.Zero(t, failed)
	assert.False(t, running)
}

// TestConcurrentAdmits: Claims admitted at the same time cannot all take
// the last record of a quota: their reservations count.
func TestConcurrentAdmits(t *testing.T) {
	s := open(t)
	pol := policy.Policy{MaxRecords: 5, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	q.WithoutWake()
	const n = 40
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- claim(t, q, s, "id", pol, claimParams("c", fmt.Sprint(i))) }()
	}
	admitted := 0
	for range n {
		if err := <-errs; err == nil {
			admitted++
		} else {
			var exceeded *quota.Exceeded
			require.ErrorAs(t, err, &exceeded)
		}
	}
	assert.Equal(t, 5, admitted)
}

// TestIdentityShare: an identity follows at most its share of consumers;
// a consumer beyond it is treated as at its quota (new keys refused, naming
// the identity), and other identities are not affected.
func TestIdentityShare(t *testing.T) {
	s := open(t)
	pol := policy.Policy{MaxRecords: 100, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 2, quiet)
	q.WithoutWake()
	require.NoError(t, claim(t, q, s, "greedy", pol, claimParams("g1", "k")))
	require.NoError(t, claim(t, q, s, "greedy", pol, claimParams("g2", "k")))
	err := claim(t, q, s, "greedy", pol, claimParams("g3", "k"))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, err, &exceeded)
	assert.Equal(t, "greedy", exceeded.Identity)
	assert.EqualValues(t, 2, exceeded.MaxConsumers)
	require.NoError(t, claim(t, q, s, "other", pol, claimParams("o1", "k")), "another identity has its own share")
}

// TestNoQuota: a consumer without a quota is neither followed nor counted.
func TestNoQuota(t *testing.T) {
	s := open(t)
	q := quota.New(s, func(string) policy.Policy { return policy.Policy{} }, 2, quiet)
	r, err := q.Admit(context.Background(), s, "id", policy.Policy{}, claimParams("c", "k"))
	require.NoError(t, err)
	assert.Nil(t, r)
	_, _, ok := q.Usage("c")
	assert.False(t, ok)
}

// TestSharedByReplicas: three replicas (three Quotas on one store) sharing
// max_records take a third each of what is left at their last count, so
// that Claims spread over them stop at the quota, not at three quotas;
// Claims that all reach one replica get its third, then a third of what
// the next count leaves.
func TestSharedByReplicas(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	pol := policy.Policy{MaxRecords: 30, Source: "test"}
	replicas := make([]*quota.Quotas, 3)
	for i := range replicas {
		replicas[i] = quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
		replicas[i].WithoutWake()
		replicas[i].ShareWith(func() int { return len(replicas) })
	}

	admitted := 0
	for i := range 90 {
		if claim(t, replicas[i%3], s, "id", pol, claimParams("spread", fmt.Sprint(i))) == nil {
			admitted++
		}
	}
	assert.Equal(t, 30, admitted, "spread over the replicas: the quota, not three quotas")

	one := replicas[0]
	admitted = 0
	for i := range 30 {
		err := claim(t, one, s, "id", pol, claimParams("one", fmt.Sprint(i)))
		if err == nil {
			admitted++
			continue
		}
		var exceeded *quota.Exceeded
		require.ErrorAs(t, err, &exceeded)
		assert.EqualValues(t, 3, exceeded.Replicas)
		assert.EqualValues(t, 10, exceeded.Records, "what the replica knows, not its share's arithmetic")
	}
	assert.Equal(t, 10, admitted, "one replica alone: its third of the quota")
	require.NoError(t, one.Refresh(ctx))
	admitted = 0
	for i := 30; i < 60; i++ {
		if claim(t, one, s, "id", pol, claimParams("one", fmt.Sprint(i))) == nil {
			admitted++
		}
	}
	assert.Equal(t, 7, admitted, "after a count of 10: a third of the 20 left, rounded up")

	// One replica alone (the others left) takes the whole quota again.
	solo := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	solo.WithoutWake()
	solo.ShareWith(func() int { return 1 })
	admitted = 0
	for i := range 40 {
		if claim(t, solo, s, "id", pol, claimParams("solo", fmt.Sprint(i))) == nil {
			admitted++
		}
	}
	assert.Equal(t, 30, admitted)
}

// TestExpiredRecordsLeaveAtRefresh: a consumer's records count until a
// refresh counts them gone: once they expired and were counted, its new
// keys are admitted again.
func TestExpiredRecordsLeaveAtRefresh(t *testing.T) {
	ctx := context.Background()
	clock := &storagetest.Clock{}
	s, err := pebble.Open(t.TempDir(), pebble.WithClock(clock.Now))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	pol := policy.Policy{MaxRecords: 2, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	q.WithoutWake()
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "a")))
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "b")))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, claim(t, q, s, "id", pol, claimParams("c", "c")), &exceeded)

	clock.Advance(2 * time.Hour) // past the records' lease and retention
	require.ErrorAs(t, claim(t, q, s, "id", pol, claimParams("c", "c")), &exceeded, "gone, but not counted yet")
	require.NoError(t, q.Refresh(ctx))
	records, _, ok := q.Usage("c")
	require.True(t, ok)
	assert.Zero(t, records)
	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "c")))
}

// TestBytes: max_bytes counts what storage.RecordBytes names; a Complete
// adds its result (never refused for it), and what the replica added
// between refreshes is what the store counts at the next.
func TestBytes(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	pol := policy.Policy{MaxBytes: 100, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	q.WithoutWake()
	first := claimParams("bytes", "b1")
	r, err := q.Admit(ctx, s, "id", pol, first)
	require.NoError(t, err)
	res, err := s.Claim(ctx, first)
	q.Claimed(r, res, err)
	require.NoError(t, err)
	require.NoError(t, q.Refresh(ctx))
	_, bytes, _ := q.Usage("bytes")
	assert.EqualValues(t, len("bytes")+len("b1")+len("h"), bytes, "the Claim's fields, as storage.RecordBytes counts them")

	require.NoError(t, claim(t, q, s, "id", pol, claimParams("bytes", "b2")))
	done := storage.CompleteParams{Key: first.Key, Token: res.Record.Token, Result: []byte(strings.Repeat("r", 90))}
	_, err = s.Complete(ctx, done)
	require.NoError(t, err)
	q.Completed(done)
	_, added, _ := q.Usage("bytes")
	require.NoError(t, q.Refresh(ctx))
	_, counted, _ := q.Usage("bytes")
	assert.Equal(t, counted, added, "what the replica added is what the store counts")
	assert.Greater(t, counted, int64(100))

	var exceeded *quota.Exceeded
	require.ErrorAs(t, claim(t, q, s, "id", pol, claimParams("bytes", "b3")), &exceeded)
	assert.EqualValues(t, 100, exceeded.MaxBytes)
	assert.Zero(t, exceeded.MaxRecords)
}

// TestRefreshFailureKeepsUsage: when the store cannot count, the refresh
// fails, is counted and logged, and every consumer keeps the usage last
// known.
func TestRefreshFailureKeepsUsage(t *testing.T) {
	ctx := context.Background()
	var logs bytes.Buffer
	s := open(t)
	pol := policy.Policy{MaxRecords: 3, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, slog.New(slog.NewJSONHandler(&logs, nil)))
	q.WithoutWake()
	for _, k := range []string{"k1", "k2", "k3"} {
		require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", k)))
	}
	require.NoError(t, q.Refresh(ctx))
	_, failedBefore, _ := q.Stats()

	require.NoError(t, s.Close()) // the store fails from now on
	require.ErrorIs(t, q.Refresh(ctx), storage.ErrUnavailable)
	_, failed, _ := q.Stats()
	assert.Equal(t, failedBefore+1, failed)
	records, _, ok := q.Usage("c")
	require.True(t, ok)
	assert.EqualValues(t, 3, records, "the usage last known stays")
	var line struct {
		Msg       string `json:"msg"`
		Consumers int    `json:"consumers"`
	}
	require.NoError(t, json.Unmarshal(bytes.TrimSpace(logs.Bytes()), &line))
	assert.Equal(t, "quota refresh failed; consumers keep the usage last known", line.Msg)
	assert.Equal(t, 1, line.Consumers)
}

// TestRunCountsFirstSeen: the loop counts a consumer as soon as its first
// Claim is in the store, not at the next interval (an hour here), reports
// its counts on the meter, and stops with its context.
func TestRunCountsFirstSeen(t *testing.T) {
	s := open(t)
	pol := policy.Policy{MaxRecords: 3, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	reader := sdkmetric.NewManualReader()
	require.NoError(t, q.Instrument(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")))
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { q.Run(ctx, time.Hour); close(stopped) }()
	require.Eventually(t, func() bool { _, _, running := q.Stats(); return running }, time.Minute, time.Millisecond)

	require.NoError(t, claim(t, q, s, "id", pol, claimParams("c", "k1")))
	require.Eventually(t, func() bool { n, _, _ := q.Stats(); return n >= 1 }, time.Minute, time.Millisecond)
	records, _, ok := q.Usage("c")
	require.True(t, ok)
	assert.EqualValues(t, 1, records)
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	counts := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == quota.MetricRefreshes {
				for _, dp := range sum.DataPoints {
					result, _ := dp.Attributes.Value("result")
					counts[result.AsString()] = dp.Value
				}
			}
		}
	}
	assert.Equal(t, map[string]int64{"ok": 1, "failed": 0}, counts)

	cancel()
	<-stopped
	_, _, running := q.Stats()
	assert.False(t, running)
}

// TestPolicyChange: a consumer whose quota a reload removed is admitted at
// once and no longer followed after the next refresh; one given a quota is
// followed from its next Claim, counted as empty until its first count.
func TestPolicyChange(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	var pols atomic.Pointer[map[string]policy.Policy]
	set := func(m map[string]policy.Policy) { pols.Store(&m) }
	polOf := func(c string) policy.Policy { return (*pols.Load())[c] }
	set(map[string]policy.Policy{"r": {MaxRecords: 1, Source: "test"}})
	q := quota.New(s, polOf, 10, quiet)
	q.WithoutWake()
	require.NoError(t, claim(t, q, s, "id", polOf("r"), claimParams("r", "k1")))
	require.NoError(t, claim(t, q, s, "id", polOf("s"), claimParams("s", "k1")))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, claim(t, q, s, "id", polOf("r"), claimParams("r", "k2")), &exceeded)

	set(map[string]policy.Policy{"s": {MaxRecords: 1, Source: "test"}})
	require.NoError(t, claim(t, q, s, "id", polOf("r"), claimParams("r", "k2")), "the quota is lifted at once")
	require.NoError(t, q.Refresh(ctx))
	_, _, followed := q.Usage("r")
	assert.False(t, followed, "a consumer without a quota is not counted")
	require.NoError(t, claim(t, q, s, "id", polOf("s"), claimParams("s", "k2")), "counted as empty until its first count")
	require.NoError(t, q.Refresh(ctx))
	require.ErrorAs(t, claim(t, q, s, "id", polOf("s"), claimParams("s", "k3")), &exceeded)
	assert.EqualValues(t, 2, exceeded.Records)
}

// TestForgetsIdleConsumers: a consumer none of whose Claims the replica
// admitted for IdleRefreshes refreshes is forgotten at the next, which
// gives its identity room for another; seen again, it is counted afresh,
// and while its identity has no room it is at its quota (new keys
// refused, live keys admitted).
func TestForgetsIdleConsumers(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	pol := policy.Policy{MaxRecords: 100, Source: "test"}
	q := quota.New(s, func(string) policy.Policy { return pol }, 2, quiet)
	q.WithoutWake()
	require.NoError(t, claim(t, q, s, "flood", pol, claimParams("c0", "k")))
	require.NoError(t, claim(t, q, s, "flood", pol, claimParams("c1", "k")))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, claim(t, q, s, "flood", pol, claimParams("c2", "k")), &exceeded)
	_, _, followed := q.Usage("c2")
	assert.False(t, followed)

	for range quota.IdleRefreshes {
		require.NoError(t, q.Refresh(ctx))
	}
	_, _, followed = q.Usage("c0")
	assert.True(t, followed, "idle for IdleRefreshes refreshes: still followed")
	require.NoError(t, claim(t, q, s, "flood", pol, claimParams("c1", "busy")))
	require.NoError(t, q.Refresh(ctx))
	_, _, followed = q.Usage("c0")
	assert.False(t, followed, "idle one refresh more: forgotten")
	_, _, followed = q.Usage("c1")
	assert.True(t, followed, "Claimed meanwhile: still followed")

	require.NoError(t, claim(t, q, s, "flood", pol, claimParams("c2", "k")), "room for one more of the identity's consumers")
	require.ErrorAs(t, claim(t, q, s, "flood", pol, claimParams("c0", "k2")), &exceeded)
	assert.Equal(t, "flood", exceeded.Identity)
	require.NoError(t, claim(t, q, s, "flood", pol, claimParams("c0", "k")), "a consumer not followed still has its live keys")
}

// TestCountAcrossReplicas: the count is the store's. Each of two replicas
// admits its half of what the quota had left; one learns of the other's
// records at its next refresh (until then it admits past the quota, the
// quota's softness), and after both refreshed both refuse, knowing all.
func TestCountAcrossReplicas(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	pol := policy.Policy{MaxRecords: 3, Source: "test"}
	a := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	b := quota.New(s, func(string) policy.Policy { return pol }, 10, quiet)
	for _, q := range []*quota.Quotas{a, b} {
		q.WithoutWake()
		q.ShareWith(func() int { return 2 })
	}
	require.NoError(t, claim(t, a, s, "id", pol, claimParams("c", "k1")))
	require.NoError(t, claim(t, a, s, "id", pol, claimParams("c", "k2")))
	var exceeded *quota.Exceeded
	require.ErrorAs(t, claim(t, a, s, "id", pol, claimParams("c", "k3")), &exceeded)
	assert.EqualValues(t, 2, exceeded.Replicas)
	require.NoError(t, claim(t, b, s, "id", pol, claimParams("c", "k3")), "b has not counted yet")
	require.NoError(t, b.Refresh(ctx))
	require.NoError(t, a.Refresh(ctx))
	for _, q := range []*quota.Quotas{a, b} {
		require.ErrorAs(t, claim(t, q, s, "id", pol, claimParams("c", "k4")), &exceeded)
		assert.EqualValues(t, 3, exceeded.Records)
	}
}
