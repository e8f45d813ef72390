package pebble

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// scanParked reads the parked index: expires_at by record key.
func scanParked(t testing.TB, s *Store) map[string]time.Time {
	t.Helper()
	out := map[string]time.Time{}
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixParked}, UpperBound: []byte{prefixParked + 1}})
	require.NoError(t, err)
	for ok := it.First(); ok; ok = it.Next() {
		exp, err := decodeParkedValue(it.Value())
		require.NoError(t, err)
		out[string(it.Key()[1:])] = exp
	}
	require.NoError(t, it.Close())
	return out
}

// requireParkedIndex checks the parked index holds exactly the parked
// records, each at its expires_at, and returns how many there are.
func requireParkedIndex(t testing.TB, s *Store) int {
	t.Helper()
	records, _ := scan(t, s)
	want := map[string]time.Time{}
	for k, rec := range records {
		if rec.State == storage.StateParked {
			want[k] = rec.ExpiresAt
		}
	}
	require.Equal(t, want, scanParked(t, s), "one parked index entry per parked record, at its expiry")
	return len(want)
}

// TestParkedIndexConsistent runs random operations that park, resolve,
// invalidate, take over and sweep, from several goroutines, and then checks
// the parked index against the records.
func TestParkedIndexConsistent(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, t.TempDir(), WithClock(clock.Now))
	ctx := t.Context()

	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 2))
			for range 400 {
				k := key(fmt.Sprintf("k%d", rng.IntN(40)))
				p := claimP(k, time.Duration(1+rng.IntN(30))*time.Second, time.Duration(rng.IntN(120)+1)*time.Second)
				p.MaxAttempts = int64(rng.IntN(3))
				rec, err := s.Inspect(ctx, k)
				token := rec.Record.Token
				if err != nil {
					token = 0
				}
				switch rng.IntN(9) {
				case 0, 1:
					_, _ = s.Claim(ctx, p)
				case 2:
					_ = s.ClaimBatch(ctx, []storage.ClaimParams{p, claimP(key(fmt.Sprintf("k%d", rng.IntN(40))), time.Second, time.Minute)})
				case 3:
					_, _ = s.Park(ctx, storage.ParkParams{Key: k, Token: token, Reason: "unknown"})
				case 4:
					_, _ = s.Complete(ctx, storage.CompleteParams{Key: k, Token: token, Result: []byte("r")})
				case 5:
					_, _ = s.Resolve(ctx, storage.ResolveParams{Key: k, Token: token, Complete: rng.IntN(2) == 0, Result: []byte("by hand"), Reason: "r"})
				case 6:
					_, _ = s.Invalidate(ctx, storage.InvalidateParams{Key: k, Reason: "r"})
				case 7:
					_, _ = s.Release(ctx, storage.ReleaseParams{Key: k, Token: token})
				case 8:
					if w == 0 {
						if _, err := s.SweepExpired(ctx, 1+rng.IntN(5)); err != nil {
							t.Error(err)
						}
					}
					clock.Advance(time.Duration(rng.IntN(20)) * time.Second)
				}
			}
		})
	}
	wg.Wait()
	require.Positive(t, requireParkedIndex(t, s), "the run parked something")
	clock.Advance(time.Hour)
	_, err := sweepAll(t, s)
	require.NoError(t, err)
	require.Zero(t, requireParkedIndex(t, s), "sweeping the expired parked records dropped their entries")
}

func sweepAll(t testing.TB, s *Store) (int, error) {
	t.Helper()
	total := 0
	for {
		res, err := s.SweepExpired(t.Context(), 100)
		if err != nil || res.Deleted == 0 {
			return total, err
		}
		total += res.Deleted
	}
}

func parkT(t testing.TB, s *Store, k storage.Key, retention time.Duration) storage.Record {
	t.Helper()
	rec := mustAcquire(t, s, claimP(k, time.Second, retention))
	parked, err := s.Park(t.Context(), storage.ParkParams{Key: k, Token: rec.Token, Reason: "unknown"})
	require.NoError(t, err)
	return parked
}

// TestParkedExpiredNotSwept: an expired parked record is neither counted
// nor listed, from the expiry the index keeps, and the sweep that deletes
// it deletes its entry.
func TestParkedExpiredNotSwept(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	short := parkT(t, s, key("short"), time.Minute)
	long := parkT(t, s, key("long"), time.Hour)
	clock.Advance(2 * time.Minute)

	counts, err := s.CountParked(t.Context(), "")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"test": 1}, counts)
	page, err := s.List(t.Context(), storage.ListParams{Consumer: "test", State: storage.StateParked, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, []storage.Key{long.Key}, keys(page.Records))
	require.Nil(t, page.Next)
	require.Len(t, scanParked(t, s), 2, "not swept yet")

	n, err := sweepAll(t, s)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Len(t, scanParked(t, s), 1)
	_, stillThere := scanParked(t, s)[string(recordKeyOf(short.Key))]
	require.False(t, stillThere, "the sweep deleted the entry with the record")
}

func keys(recs []storage.Record) []storage.Key {
	out := make([]storage.Key, 0, len(recs))
	for _, r := range recs {
		out = append(out, r.Key)
	}
	return out
}

// TestListNext pins where a page says the next one starts: after its last
// record when full, after the last entry it read when its window ran out
// (also when that entry ends the range), and nowhere at the end.
func TestListNext(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	ctx := t.Context()
	n := storage.ListScanLimit(1)
	ps := make([]storage.ClaimParams, n)
	for i := range ps {
		ps[i] = claimP(key(fmt.Sprintf("k%05d", i)), time.Minute, time.Hour)
	}
	for _, a := range s.ClaimBatch(ctx, ps) {
		require.NoError(t, a.Err)
	}
	list := func(p storage.ListParams) storage.ListResult {
		t.Helper()
		p.Consumer = "test"
		res, err := s.List(ctx, p)
		require.NoError(t, err)
		require.True(t, res.Now.Equal(clock.Now().UTC().Truncate(time.Microsecond)))
		return res
	}

	page := list(storage.ListParams{Limit: 2})
	require.Equal(t, []storage.Key{ps[0].Key, ps[1].Key}, keys(page.Records))
	require.Equal(t, &ps[1].Key, page.Next, "a full page goes on after its last record")
	page = list(storage.ListParams{Limit: 2, After: page.Next})
	require.Equal(t, []storage.Key{ps[2].Key, ps[3].Key}, keys(page.Records), "After is exclusive")

	page = list(storage.ListParams{Limit: 2, After: &ps[n-2].Key})
	require.Equal(t, []storage.Key{ps[n-1].Key}, keys(page.Records))
	require.Nil(t, page.Next, "the range ended before the page filled")
	page = list(storage.ListParams{Limit: 1, After: &ps[n-2].Key})
	require.Equal(t, &ps[n-1].Key, page.Next, "a full page goes on, even when it holds the last record")
	page = list(storage.ListParams{Limit: 1, After: page.Next})
	require.Empty(t, page.Records)
	require.Nil(t, page.Next)

	page = list(storage.ListParams{Limit: 1, State: storage.StateCompleted})
	require.Empty(t, page.Records)
	require.Equal(t, &ps[n-1].Key, page.Next, "the window of %d entries ran out on the last record", n)
	page = list(storage.ListParams{Limit: 1, State: storage.StateCompleted, After: page.Next})
	require.Empty(t, page.Records)
	require.Nil(t, page.Next)

	// A consumer past the key range, or an After past it, is an empty end.
	res, err := s.List(ctx, storage.ListParams{Consumer: "test", Limit: 1, After: &storage.Key{Consumer: "z"}})
	require.NoError(t, err)
	require.Empty(t, res.Records)
	require.Nil(t, res.Next)
	_, err = s.List(ctx, storage.ListParams{Consumer: "test"})
	require.Error(t, err, "a page of no records is a caller's mistake")
}

// TestListEscapedConsumers lists and counts consumers whose names hold the
// bytes the record key escapes or ends on, exactly and by prefix.
func TestListEscapedConsumers(t *testing.T) {
	s := openT(t, "", WithInMemory())
	consumers := []string{"a", "a\x00", "a\x00\x01", "a\x00b", "a\x01", "ab", "a\xff", "a\xff\xff", "b"} // in byte order
	for _, c := range consumers {
		for _, k := range []string{"1", "\x00"} {
			parkT(t, s, storage.Key{Consumer: c, Kind: storage.KindMessage, Key: k}, time.Hour)
		}
	}
	for _, prefix := range []string{"", "a", "a\x00", "a\x00\x01", "a\xff", "a\xff\xff", "c"} {
		var wantList []storage.Key
		wantCount := map[string]int64{}
		for _, c := range consumers {
			if strings.HasPrefix(c, prefix) {
				wantList = append(wantList, storage.Key{Consumer: c, Kind: storage.KindMessage, Key: "\x00"}, storage.Key{Consumer: c, Kind: storage.KindMessage, Key: "1"})
				wantCount[c] = 2
			}
		}
		counts, err := s.CountParked(t.Context(), prefix)
		require.NoError(t, err)
		require.Equal(t, wantCount, counts, "prefix %q", prefix)
		for _, state := range []storage.State{0, storage.StateParked} {
			var got []storage.Key
			p := storage.ListParams{Consumer: prefix, Prefix: true, State: state, Limit: 3}
			for {
				page, err := s.List(t.Context(), p)
				require.NoError(t, err)
				got = append(got, keys(page.Records)...)
				if page.Next == nil {
					break
				}
				p.After = page.Next
			}
			require.Equal(t, wantList, got, "prefix %q, state %d", prefix, state)
		}
		page, err := s.List(t.Context(), storage.ListParams{Consumer: prefix, State: storage.StateParked, Limit: 10})
		require.NoError(t, err)
		require.Len(t, page.Records, int(wantCount[prefix]), "exactly %q", prefix)
		for _, r := range page.Records {
			require.Equal(t, prefix, r.Consumer)
		}
	}
}

// TestAnswersCarryNoHistory: a record with a history answers every call
// but Inspect and List without it, so both stores answer alike.
func TestAnswersCarryNoHistory(t *testing.T) {
	clock := newFakeClock()
	s := openT(t, "", WithInMemory(), WithClock(clock.Now))
	ctx := t.Context()
	k := key("k")
	first := mustAcquire(t, s, claimP(k, time.Second, time.Hour))
	clock.Advance(2 * time.Second)
	second := mustAcquire(t, s, claimP(k, time.Minute, time.Hour))
	got, err := s.Inspect(ctx, k)
	require.NoError(t, err)
	require.Len(t, got.Record.History, 1)
	require.Equal(t, first.Token, got.Record.History[0].Token)

	answers := map[string]storage.Record{"takeover": second}
	add := func(name string, rec storage.Record, err error) {
		t.Helper()
		require.NoError(t, err, name)
		answers[name] = rec
	}
	res, err := s.Claim(ctx, claimP(k, time.Minute, time.Hour))
	add("claim in progress", res.Record, err)
	rec, err := s.Lookup(ctx, k)
	add("lookup", rec, err)
	rec, err = s.Extend(ctx, storage.ExtendParams{Key: k, Token: second.Token, Lease: time.Minute})
	add("extend", rec, err)
	batch := s.ClaimBatch(ctx, []storage.ClaimParams{claimP(k, time.Minute, time.Hour)})
	add("claim batch", batch[0].Result.Record, batch[0].Err)
	rec, err = s.Release(ctx, storage.ReleaseParams{Key: k, Token: second.Token})
	add("release", rec, err)
	third := mustAcquire(t, s, claimP(k, time.Minute, time.Hour))
	rec, err = s.Park(ctx, storage.ParkParams{Key: k, Token: third.Token, Reason: "unknown"})
	add("park", rec, err)
	res, err = s.Claim(ctx, claimP(k, time.Minute, time.Hour))
	add("claim parked", res.Record, err)
	rec, err = s.Resolve(ctx, storage.ResolveParams{Key: k, Token: rec.Token, Reason: "release"})
	add("resolve", rec, err)
	fourth := mustAcquire(t, s, claimP(k, time.Minute, time.Hour))
	done := s.CompleteBatch(ctx, []storage.CompleteParams{{Key: k, Token: fourth.Token, Result: []byte("r")}})
	add("complete batch", done[0].Record, done[0].Err)
	rec, err = s.Complete(ctx, storage.CompleteParams{Key: k, Token: fourth.Token, Result: []byte("r")})
	add("complete repeated", rec, err)
	res, err = s.Claim(ctx, claimP(k, time.Minute, time.Hour))
	add("claim replay", res.Record, err)
	rec, err = s.Invalidate(ctx, storage.InvalidateParams{Key: k, Reason: "wrong"})
	add("invalidate", rec, err)
	for name, rec := range answers {
		require.Nil(t, rec.History, name)
	}

	got, err = s.Inspect(ctx, k)
	require.NoError(t, err)
	ends := make([]storage.AttemptEnd, 0, len(got.Record.History))
	for _, a := range got.Record.History {
		ends = append(ends, a.End)
	}
	require.Equal(t, []storage.AttemptEnd{storage.AttemptTakenOver, storage.AttemptTakenOver, storage.AttemptResolvedReleased, storage.AttemptInvalidated}, ends)
	page, err := s.List(ctx, storage.ListParams{Consumer: "test", Limit: 1})
	require.NoError(t, err)
	require.Equal(t, got.Record.History, page.Records[0].History, "List returns the history Inspect does")
}

// v1 turns s's directory into what a version 1 binary left: no parked
// index, version 1 stamped.
func v1(t testing.TB, s *Store) {
	t.Helper()
	require.NoError(t, s.db.DeleteRange([]byte{prefixParked}, []byte{prefixParked + 1}, pebble.Sync))
	require.NoError(t, s.db.Set(metaFormat, []byte{layoutVersionV1}, pebble.Sync))
	require.Empty(t, scanParked(t, s))
}

func requireLayout(t testing.TB, s *Store, want byte) {
	t.Helper()
	v, closer, err := s.db.Get(metaFormat)
	require.NoError(t, err)
	require.Equal(t, []byte{want}, v)
	require.NoError(t, closer.Close())
}

// TestMigrateV1 opens a version 1 directory: Open builds the parked index
// from the records, live and expired ones alike, and stamps version 2.
func TestMigrateV1(t *testing.T) {
	fs := vfs.NewMem()
	clock := newFakeClock()
	s, err := Open("/data", withFS(fs), WithClock(clock.Now), WithLogger(testLogger(t)))
	require.NoError(t, err)
	ctx := t.Context()
	expired := parkT(t, s, key("expired"), time.Minute)
	live := parkT(t, s, storage.Key{Consumer: "other", Kind: storage.KindMessage, Key: "live"}, time.Hour)
	atMax := claimP(key("max"), time.Second, time.Hour)
	atMax.MaxAttempts = 1
	mustAcquire(t, s, atMax)
	done := mustAcquire(t, s, claimP(key("done"), time.Second, time.Hour))
	mustComplete(t, s, key("done"), done.Token, "r")
	clock.Advance(2 * time.Minute)
	res, err := s.Claim(ctx, atMax)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeParked, res.Outcome)
	mustAcquire(t, s, claimP(key("busy"), time.Minute, time.Hour))
	want := scanParked(t, s)
	require.Len(t, want, 3)
	v1(t, s)
	require.NoError(t, s.Close())

	s = openT(t, "/data", withFS(fs), WithClock(clock.Now))
	requireLayout(t, s, layoutVersion)
	require.Equal(t, want, scanParked(t, s))
	requireParkedIndex(t, s)
	counts, err := s.CountParked(ctx, "")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"test": 1, "other": 1}, counts, "the expired one is indexed, not counted")
	page, err := s.List(ctx, storage.ListParams{Consumer: "", Prefix: true, State: storage.StateParked, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, []storage.Key{live.Key, key("max")}, keys(page.Records))

	n, err := sweepAll(t, s)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, ok := scanParked(t, s)[string(recordKeyOf(expired.Key))]
	require.False(t, ok, "the sweeper deletes a migrated entry with its record")
	require.NoError(t, s.Close())

	s = openT(t, "/data", withFS(fs), WithClock(clock.Now))
	requireParkedIndex(t, s)
}

// TestMigrateV1Large migrates more parked records than one batch holds.
func TestMigrateV1Large(t *testing.T) {
	fs := vfs.NewMem()
	clock := newFakeClock()
	s, err := Open("/data", withFS(fs), WithClock(clock.Now), WithLogger(testLogger(t)))
	require.NoError(t, err)
	now := s.clock()
	n := migrateBatch*51/50 + 100 // parked: just over one batch
	b := s.db.NewBatch()
	for i := range n {
		rec := storage.Record{Key: key(fmt.Sprintf("k%06d", i)), State: storage.StateInProgress, Token: int64(i + 1), Attempt: 1,
			CreatedAt: now, LeaseExpiresAt: now, ExpiresAt: now.Add(time.Hour), Retention: time.Hour}
		if i%50 != 1 {
			rec.State, rec.ParkReason = storage.StateParked, "p"
		}
		require.NoError(t, addWrite(b, recordKeyOf(rec.Key), nil, &rec))
	}
	require.NoError(t, b.Commit(pebble.Sync))
	require.NoError(t, b.Close())
	v1(t, s)
	require.NoError(t, s.Close())

	s = openT(t, "/data", withFS(fs), WithClock(clock.Now))
	requireLayout(t, s, layoutVersion)
	parked := n - (n+48)/50
	require.Greater(t, parked, migrateBatch)
	require.Equal(t, parked, requireParkedIndex(t, s))
	counts, err := s.CountParked(t.Context(), "te")
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"test": int64(parked)}, counts)
}

func TestOpenRefusesUnknownLayout(t *testing.T) {
	fs := vfs.NewMem()
	s, err := Open("/data", withFS(fs), WithLogger(testLogger(t)))
	require.NoError(t, err)
	require.NoError(t, s.db.Set(metaFormat, []byte{layoutVersion + 1}, pebble.Sync))
	require.NoError(t, s.Close())
	_, err = Open("/data", withFS(fs), WithLogger(testLogger(t)))
	require.ErrorContains(t, err, "unknown layout version 03")
}

// TestMigrateV1SkipsUndecodable: a record the migration cannot decode is
// left to fail its own calls, as it did before; Open and every other key
// go on.
func TestMigrateV1SkipsUndecodable(t *testing.T) {
	fs := vfs.NewMem()
	s, err := Open("/data", withFS(fs), WithLogger(testLogger(t)))
	require.NoError(t, err)
	parked := parkT(t, s, key("parked"), time.Hour)
	require.NoError(t, s.db.Set(recordKeyOf(key("bad")), []byte{valueVersion4 + 1, 0, 0}, pebble.Sync))
	v1(t, s)
	require.NoError(t, s.Close())

	s = openT(t, "/data", withFS(fs))
	requireLayout(t, s, layoutVersion)
	require.Equal(t, map[string]time.Time{string(recordKeyOf(parked.Key)): parked.ExpiresAt}, scanParked(t, s))
	_, err = s.Inspect(t.Context(), key("bad"))
	require.ErrorIs(t, err, storage.ErrUnavailable)
}
