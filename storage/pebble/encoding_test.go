package pebble

import (
	"bytes"
	"cmp"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

func compareKeys(a, b storage.Key) int {
	return cmp.Or(cmp.Compare(a.Consumer, b.Consumer), cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Key, b.Key))
}

func TestRecordKeyOrderAndRoundTrip(t *testing.T) {
	keys := []storage.Key{
		{Consumer: "", Kind: storage.KindMessage, Key: ""},
		{Consumer: "", Kind: storage.KindOperation, Key: "a"},
		{Consumer: "a", Kind: storage.KindMessage, Key: "x"},
		{Consumer: "a", Kind: storage.KindOperation, Key: ""},
		{Consumer: "a\x00", Kind: storage.KindMessage, Key: "\x00"},
		{Consumer: "a\x00\x01", Kind: storage.KindMessage, Key: "\xff"},
		{Consumer: "a\x00b", Kind: storage.KindMessage, Key: "y"},
		{Consumer: "a\x01", Kind: storage.KindMessage, Key: "y"},
		{Consumer: "ab", Kind: storage.KindMessage, Key: "y\x00z"},
		{Consumer: "b", Kind: storage.KindMessage, Key: ""},
	}
	for i, k := range keys {
		enc := recordKeyOf(k)
		got, err := decodeRecordKey(enc)
		require.NoError(t, err)
		require.Equal(t, k, got)
		for _, other := range keys[i+1:] {
			require.Negative(t, compareKeys(k, other), "test table out of order")
			require.Negative(t, bytes.Compare(enc, recordKeyOf(other)), "%q sorts after %q", k, other)
		}
	}
}

func FuzzRecordKey(f *testing.F) {
	f.Add("consumer", uint8(1), "key", "consumer\x00", uint8(1), "")
	f.Add("a", uint8(2), "\x00\x01", "a\x00", uint8(1), "\x00")
	f.Fuzz(func(t *testing.T, c1 string, k1 uint8, key1, c2 string, k2 uint8, key2 string) {
		a := storage.Key{Consumer: c1, Kind: storage.Kind(k1), Key: key1}
		b := storage.Key{Consumer: c2, Kind: storage.Kind(k2), Key: key2}
		ea, eb := recordKeyOf(a), recordKeyOf(b)
		got, err := decodeRecordKey(ea)
		require.NoError(t, err)
		require.Equal(t, a, got)
		require.Equal(t, compareKeys(a, b), bytes.Compare(ea, eb), "order of %q and %q", a, b)
		_, _ = decodeRecordKey(append([]byte{prefixRecord}, key1...)) // never panics
	})
}

func TestExpiryKeyRoundTrip(t *testing.T) {
	rk := recordKeyOf(storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"})
	times := []time.Time{
		time.UnixMicro(-5).UTC(),
		time.UnixMicro(0).UTC(),
		time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC),
		time.Date(2030, 1, 2, 3, 4, 5, 7000, time.UTC),
	}
	for i, tm := range times {
		enc := appendExpiryKey(nil, tm, rk)
		got, gotKey, err := decodeExpiryKey(enc)
		require.NoError(t, err)
		require.Equal(t, tm, got)
		require.Equal(t, rk, gotKey)
		if i > 0 {
			require.Negative(t, bytes.Compare(appendExpiryKey(nil, times[i-1], rk), enc))
		}
	}
}

func FuzzRecordValue(f *testing.F) {
	f.Add(uint8(2), []byte("fp"), int64(1_800_000_000_000_000), int64(3), "holder", int64(1_800_000_000_000_000), int64(10_000_000_000), true, int64(3_600_000_000_000), []byte("result"), "", int64(0))
	f.Add(uint8(1), []byte(nil), int64(1), int64(1), "", int64(0), int64(1), false, int64(1), []byte(nil), "", int64(0))
	f.Add(uint8(1), []byte("fp"), int64(7), int64(2), "pod-a", int64(1_800_000_000_000_000), int64(10_000_000_000), false, int64(1), []byte("r"), "0f8fad5b-d9cb-469f-a165-70867728950e", int64(30_000_000_000))
	f.Add(uint8(1), []byte("fp"), int64(7), int64(2), "pod-a", int64(1_800_000_000_000_000), int64(10_000_000_000), false, int64(1), []byte("r"), "", int64(30_000_000_000))
	f.Fuzz(func(t *testing.T, state uint8, fp []byte, token, attempt int64, holder string, createdNs, leaseNs int64, completed bool, retention int64, result []byte, requestID string, leaseLen int64) {
		created := time.Unix(0, createdNs)
		rec := storage.Record{
			Key:            storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"},
			State:          storage.State(state),
			Fingerprint:    fp,
			Token:          token,
			Attempt:        attempt,
			Holder:         holder,
			RequestID:      requestID,
			Lease:          time.Duration(leaseLen),
			CreatedAt:      created,
			LeaseExpiresAt: created.Add(time.Duration(leaseNs)),
			ExpiresAt:      created.Add(time.Duration(leaseNs) + time.Duration(retention)),
			Retention:      time.Duration(retention),
			Result:         result,
		}
		if completed {
			rec.CompletedAt = created.Add(time.Second)
		}
		normalize(&rec)
		if len(rec.Fingerprint) == 0 {
			rec.Fingerprint = nil
		}
		if len(rec.Result) == 0 {
			rec.Result = nil
		}
		enc := appendRecord(nil, &rec)
		require.Len(t, enc, recordSize(&rec))
		got := storage.Record{Key: rec.Key}
		require.NoError(t, decodeRecord(enc, &got))
		require.Equal(t, rec, got)

		if requestID == "" && rec.Lease == 0 {
			require.Equal(t, valueVersion1, enc[0], "a record without a request id or a lease keeps the version 1 layout")
		}

		for n := range enc { // a truncated value fails or decodes, never panics
			_ = decodeRecord(enc[:n], &got)
		}
	})
}

func TestRecordValueParked(t *testing.T) {
	created := time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)
	rec := storage.Record{
		Key: storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}, State: storage.StateParked,
		Fingerprint: []byte("fp"), Token: 7, Attempt: 3, Holder: "pod-a", RequestID: "r", Lease: time.Second,
		CreatedAt: created, LeaseExpiresAt: created.Add(time.Second), ExpiresAt: created.Add(time.Hour), Retention: time.Hour,
		ParkReason: "sent, no answer",
	}
	enc := appendRecord(nil, &rec)
	require.Equal(t, valueVersion3, enc[0], "a parked record's reason needs version 3")
	require.Len(t, enc, recordSize(&rec))
	got := storage.Record{Key: rec.Key}
	require.NoError(t, decodeRecord(enc, &got))
	require.Equal(t, rec, got)

	rec.State, rec.ParkReason = storage.StateInProgress, ""
	require.Equal(t, valueVersion2, appendRecord(nil, &rec)[0], "other records keep the layout older binaries read")
}

// history is a full history of varied entries, as the Decide functions
// leave it: oldest first, times in microseconds.
func history() []storage.Attempt {
	at := time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)
	return []storage.Attempt{
		{Attempt: 1, Token: 100, Holder: "pod-a", EndedAt: at, End: storage.AttemptTakenOver},
		{Attempt: 2, Token: 101, Holder: "pod-b", EndedAt: at.Add(time.Second), End: storage.AttemptInvalidated, ParkReason: "sent, no answer", Note: "provider says no"},
		{Attempt: 0, Token: 102, EndedAt: at.Add(2 * time.Second), End: storage.AttemptInvalidated},
		{Attempt: 1, Token: 103, Holder: "pod-c", EndedAt: at.Add(3 * time.Second), End: storage.AttemptResolvedReleased, ParkReason: storage.ParkReasonMaxAttempts, Note: "fixed"},
		{Attempt: 1, Token: 1 << 60, Holder: "pod-d", EndedAt: time.UnixMicro(-5).UTC(), End: storage.AttemptResolvedCompleted, Note: "by hand"},
	}
}

func TestRecordValueHistory(t *testing.T) {
	created := time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)
	base := storage.Record{
		Key: storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}, State: storage.StateCompleted,
		Fingerprint: []byte("fp"), Token: 1<<60 + 1, Attempt: 2, Holder: "pod-e", RequestID: "r", Lease: time.Second,
		CreatedAt: created, LeaseExpiresAt: created.Add(time.Second), CompletedAt: created.Add(time.Second / 2),
		ExpiresAt: created.Add(time.Hour), Retention: time.Hour, Result: []byte("result"),
	}
	for _, tc := range []struct {
		name string
		edit func(r *storage.Record)
	}{
		{"full", nil},
		{"one entry", func(r *storage.Record) { r.History = r.History[:1] }},
		{"parked, without request id, lease or result", func(r *storage.Record) {
			r.State, r.ParkReason, r.RequestID, r.Lease, r.Result, r.CompletedAt = storage.StateParked, "p", "", 0, nil, time.Time{}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := base
			rec.History = history()
			if tc.edit != nil {
				tc.edit(&rec)
			}
			enc := appendRecord(nil, &rec)
			require.Equal(t, valueVersion4, enc[0], "a history needs version 4")
			require.Len(t, enc, recordSize(&rec))
			got := storage.Record{Key: rec.Key}
			require.NoError(t, decodeRecord(enc, &got))
			require.Equal(t, rec, got)

			meta := storage.Record{Key: rec.Key, Result: []byte("stale")}
			require.NoError(t, decodeRecordMeta(enc, &meta))
			want := rec
			want.Result = nil
			require.Equal(t, want, meta, "a listing's read has everything but the result")

			for n := range enc { // a truncated value fails or decodes, never panics
				_ = decodeRecord(enc[:n], &got)
			}
		})
	}

	rec := base
	require.NotEqual(t, valueVersion4, appendRecord(nil, &rec)[0], "a record without history keeps the layout older binaries read")
}

// TestRecordValueOlderVersions decodes values of versions 1 to 3 as the
// binary before version 4 wrote them (hex from that build): they decode
// without history, and a record without history is still written the same,
// byte for byte.
func TestRecordValueOlderVersions(t *testing.T) {
	created := time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)
	base := storage.Record{State: storage.StateInProgress, Fingerprint: []byte("fp"), Token: 7, Attempt: 2, Holder: "pod-a",
		CreatedAt: created, LeaseExpiresAt: created.Add(time.Second), ExpiresAt: created.Add(time.Hour), Retention: time.Hour}
	v1 := base
	v1.State, v1.CompletedAt, v1.Result = storage.StateCompleted, created.Add(time.Second/2), []byte("result")
	v2 := base
	v2.RequestID, v2.Lease = "req", time.Second
	v3 := v2
	v3.State, v3.ParkReason = storage.StateParked, "sent, no answer"
	for _, tc := range []struct {
		hex  string
		want storage.Record
	}{
		{"0102010e028ccd9ec7a88bdd068cd698c8a88bdd06ccd1dbc7a88bdd068cddbbb0c38bdd0680909de91a02667005706f642d61726573756c74", v1},
		{"0201000e028ccd9ec7a88bdd068cd698c8a88bdd068cddbbb0c38bdd0680909de91a02667005706f642d610372657180897a", v2},
		{"0303000e028ccd9ec7a88bdd068cd698c8a88bdd068cddbbb0c38bdd0680909de91a02667005706f642d610372657180897a0f73656e742c206e6f20616e73776572", v3},
	} {
		enc, err := hex.DecodeString(tc.hex)
		require.NoError(t, err)
		got := storage.Record{History: history()}
		require.NoError(t, decodeRecord(enc, &got))
		require.Equal(t, tc.want, got, "version %d", enc[0])
		require.Nil(t, got.History)
		require.Equal(t, enc, appendRecord(nil, &tc.want), "version %d is written as before", enc[0])
	}
}

func FuzzRecordValueHistory(f *testing.F) {
	f.Add(uint8(3), "reason", int64(100), int64(1), "pod-a", int64(1_800_000_000_000_000), uint8(1), "", "", uint8(5), []byte("result"))
	f.Add(uint8(1), "", int64(-1), int64(0), "", int64(-5), uint8(4), "max_attempts reached", "note", uint8(1), []byte(nil))
	f.Fuzz(func(t *testing.T, state uint8, parkReason string, token, attempt int64, holder string, endedMicros int64, end uint8, entryReason, note string, n uint8, result []byte) {
		rec := storage.Record{
			Key: storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}, State: storage.State(state), ParkReason: parkReason,
			Token: token + 1, CreatedAt: time.UnixMicro(0).UTC(), LeaseExpiresAt: time.UnixMicro(0).UTC(), ExpiresAt: time.UnixMicro(0).UTC(),
		}
		if len(result) > 0 {
			rec.Result = result
		}
		for i := range int(n % 8) {
			rec.History = append(rec.History, storage.Attempt{Attempt: attempt + int64(i), Token: token + int64(i), Holder: holder,
				EndedAt: time.UnixMicro(endedMicros).UTC(), End: storage.AttemptEnd(end), ParkReason: entryReason, Note: note})
		}
		enc := appendRecord(nil, &rec)
		require.Len(t, enc, recordSize(&rec))
		got := storage.Record{Key: rec.Key}
		require.NoError(t, decodeRecord(enc, &got))
		require.Equal(t, rec, got)
		for i := range enc { // a truncated value fails or decodes, never panics
			_ = decodeRecord(enc[:i], &got)
		}
	})
}

func TestParkedValueRoundTrip(t *testing.T) {
	for _, tm := range []time.Time{time.UnixMicro(-5).UTC(), time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)} {
		got, err := decodeParkedValue(appendParkedValue(nil, tm))
		require.NoError(t, err)
		require.Equal(t, tm, got)
	}
	_, err := decodeParkedValue([]byte{1, 2, 3})
	require.Error(t, err)
}

// FuzzConsumerPrefix checks the ranges List and CountParked walk: the
// record keys that start with consumerPrefix(p, true) are those of the
// consumers whose name starts with p, those that start with
// consumerPrefix(p, false) those of p itself, and prefixEnd bounds them.
func FuzzConsumerPrefix(f *testing.F) {
	f.Add("a", "ab", uint8(1), "k")
	f.Add("a\x00", "a", uint8(1), "\x00\xff")
	f.Add("a", "a\x00\x01", uint8(2), "")
	f.Add("\xff\xff", "\xff\xff\xff", uint8(1), "k")
	f.Add("", "x", uint8(2), "k")
	f.Fuzz(func(t *testing.T, prefix, consumer string, kind uint8, key string) {
		rk := recordKeyOf(storage.Key{Consumer: consumer, Kind: storage.Kind(kind), Key: key})
		for _, exact := range []bool{false, true} {
			lower := consumerPrefix(prefix, !exact)
			want := strings.HasPrefix(consumer, prefix)
			if exact {
				want = consumer == prefix
			}
			require.Equal(t, want, bytes.HasPrefix(rk, lower), "consumer %q, prefix %q, exact %v", consumer, prefix, exact)
			upper := prefixEnd(lower)
			inRange := bytes.Compare(rk, lower) >= 0 && (upper == nil || bytes.Compare(rk, upper) < 0)
			require.Equal(t, want, inRange, "consumer %q, range of %q, exact %v", consumer, prefix, exact)
		}
	})
}
