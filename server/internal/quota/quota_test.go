package quota_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
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
