package storage

import "context"

// UsageCounter is implemented by stores that can count what a consumer
// keeps, for the server's per-consumer quotas (max_records, max_bytes).
// It is a separate capability because only the quota refresh uses it, and
// off the request path: a count reads every stored record of the
// consumers asked about, so the server asks for the consumers that have a
// quota only, every --quota-refresh, never on a Claim.
type UsageCounter interface {
	// ConsumerUsage counts, for each of consumers, its live records
	// (ExpiresAt after the store's clock; expired records not yet swept do
	// not count) and their RecordBytes. The map has an entry for every
	// consumer asked about, zero for one with no live record. The count is
	// a snapshot, not a lock: Claims may add records while it runs.
	// Errors: ErrUnavailable.
	ConsumerUsage(ctx context.Context, consumers []string) (map[string]Usage, error)
}

// Usage is what one consumer's live records hold.
type Usage struct {
	// Records is the number of live records.
	Records int64
	// Bytes is the sum of their RecordBytes.
	Bytes int64
}

// RecordBytes is what a record counts against its consumer's max_bytes:
// the bytes of the fields a caller chose, as they are stored — consumer,
// key, fingerprint, holder, request id, park reason and the encoded
// result. The attempt history (at most MaxHistory entries of a holder, a
// park reason and an operator's reason, each bounded by the server) is
// not counted either, nor are the
// fixed-size fields (state, tokens, times, durations) and each store's own
// overhead (row headers, indexes, pebble's key encoding and its expiry
// index) are not counted, so a store holds somewhat more than this, by a
// bounded amount per record (max_records bounds that).
func RecordBytes(r *Record) int64 {
	return int64(len(r.Consumer) + len(r.Key.Key) + len(r.Fingerprint) + len(r.Holder) + len(r.RequestID) + len(r.ParkReason) + len(r.Result))
}
