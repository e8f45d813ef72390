package pebble

import (
	"bytes"
	"cmp"
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
