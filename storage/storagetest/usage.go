package storagetest

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// usageCases are the cases of the storage.UsageCounter capability. Every
// case uses consumers of its own, so stores may be shared.
var usageCases = []testCase[storage.UsageCounter]{
	{"NoRecords", testUsageNoRecords},
	{"CountsRecordsAndBytes", testUsageCounts},
	{"ExpiredNotCounted", testUsageExpired},
	{"ConsumersApart", testUsageConsumersApart},
	{"NoConsumers", testUsageNoConsumers},
}

// newConsumer returns a consumer name under prefix that no other case
// uses, so that a case sees only its own records even when stores are
// shared.
func newConsumer(prefix string) string {
	return fmt.Sprintf("%s.c-%d-%d", prefix, time.Now().UnixNano(), keySeq.Add(1))
}

func testUsageNoRecords(t *testing.T, _ storage.Store, u storage.UsageCounter, _ *Clock) {
	a, b := newConsumer("usage"), newConsumer("usage")
	got, err := u.ConsumerUsage(t.Context(), []string{a, b})
	require.NoError(t, err)
	require.Equal(t, map[string]storage.Usage{a: {}, b: {}}, got, "a consumer with no record has an entry of zeros")
}

func testUsageNoConsumers(t *testing.T, _ storage.Store, u storage.UsageCounter, _ *Clock) {
	got, err := u.ConsumerUsage(t.Context(), nil)
	require.NoError(t, err)
	require.Empty(t, got)
}

// testUsageCounts: live records are counted whatever their state, and
// their bytes are those RecordBytes names: consumer, key, fingerprint,
// holder, request id and result, counted here by hand.
func testUsageCounts(t *testing.T, s storage.Store, u storage.UsageCounter, _ *Clock) {
	consumer := newConsumer("usage")
	ctx := t.Context()
	want := storage.Usage{}
	add := func(key, fp, holder, requestID, result string) {
		want.Records++
		want.Bytes += int64(len(consumer) + len(key) + len(fp) + len(holder) + len(requestID) + len(result))
	}

	// In progress, with everything a Claim sets.
	p := storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindOperation, Key: "in-progress"},
		Fingerprint: []byte("fp-1"), Lease: lease, Retention: retention, Holder: "holder-a", RequestID: "req-1"}
	acquire(t, s, p)
	add("in-progress", "fp-1", "holder-a", "req-1", "")

	// Completed: the result counts too.
	k := storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: "completed"}
	rec := acquire(t, s, storage.ClaimParams{Key: k, Lease: lease, Retention: retention, Holder: "h"})
	complete(t, s, k, rec.Token, "a result of some length")
	add("completed", "", "h", "", "a result of some length")

	// The same key string under the other kind is another record.
	acquire(t, s, storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: "in-progress"}, Lease: lease, Retention: retention})
	add("in-progress", "", "", "", "")

	// Claims that write nothing new add nothing: a replay, an in-progress
	// answer.
	res, err := s.Claim(ctx, storage.ClaimParams{Key: k, Lease: lease, Retention: retention})
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeCompleted, res.Outcome)
	res, err = s.Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Repeated)

	got, err := u.ConsumerUsage(ctx, []string{consumer})
	require.NoError(t, err)
	require.Equal(t, map[string]storage.Usage{consumer: want}, got)
	lookedUp, err := s.Lookup(ctx, k)
	require.NoError(t, err)
	require.Equal(t, int64(len(consumer)+len("completed")+len("h")+len("a result of some length")), storage.RecordBytes(&lookedUp),
		"RecordBytes of a stored record counts what the store does")
}

// testUsageExpired: a record whose lease ran out still counts until its
// retention ends; then it counts as absent, swept or not.
func testUsageExpired(t *testing.T, s storage.Store, u storage.UsageCounter, c *Clock) {
	consumer := newConsumer("usage")
	ctx := t.Context()
	acquire(t, s, storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: "short"}, Lease: lease, Retention: time.Minute})
	acquire(t, s, storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindMessage, Key: "long"}, Lease: lease, Retention: retention})
	one := int64(len(consumer) + len("long"))

	c.Advance(lease + time.Second) // both leases over, both retained
	got, err := u.ConsumerUsage(ctx, []string{consumer})
	require.NoError(t, err)
	require.Equal(t, storage.Usage{Records: 2, Bytes: 2*one + 1}, got[consumer])

	c.Advance(time.Minute) // "short" expired, not swept
	got, err = u.ConsumerUsage(ctx, []string{consumer})
	require.NoError(t, err)
	require.Equal(t, storage.Usage{Records: 1, Bytes: one}, got[consumer], "an expired record does not count")

	c.Advance(retention)
	got, err = u.ConsumerUsage(ctx, []string{consumer})
	require.NoError(t, err)
	require.Equal(t, storage.Usage{}, got[consumer])
}

// testUsageConsumersApart: consumers are counted apart, also one whose
// name is a prefix of another's, and consumers not asked about are left
// out.
func testUsageConsumersApart(t *testing.T, s storage.Store, u storage.UsageCounter, _ *Clock) {
	a := newConsumer("usage")
	ab, other := a+"b", a+".other"
	for i, consumer := range []string{a, ab, ab, other} {
		acquire(t, s, storage.ClaimParams{Key: storage.Key{Consumer: consumer, Kind: storage.KindOperation, Key: fmt.Sprintf("k%d", i)},
			Lease: lease, Retention: retention})
	}
	got, err := u.ConsumerUsage(t.Context(), []string{a, ab})
	require.NoError(t, err)
	require.Equal(t, map[string]storage.Usage{
		a:  {Records: 1, Bytes: int64(len(a) + 2)},
		ab: {Records: 2, Bytes: int64(2 * (len(ab) + 2))},
	}, got)
}
