package pebble

import (
	"context"

	"github.com/cockroachdb/pebble/v2"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.UsageCounter = (*Store)(nil)

// ConsumerUsage scans the record keys of each consumer: they share the
// prefix of the escaped consumer and its terminator (encoding.go), so a
// consumer's scan reads its records and no other's, expired ones included.
// The scan reads a snapshot without the key locks: a write whose WAL sync
// is still running may already count, which a count that is a soft bound
// anyway can afford.
func (s *Store) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	if err := s.begin(ctx); err != nil {
		return nil, err
	}
	defer s.end()
	now := s.clock()
	out := make(map[string]storage.Usage, len(consumers))
	var rec storage.Record
	for _, consumer := range consumers {
		if err := ctx.Err(); err != nil {
			return nil, unavailable("count usage", err)
		}
		lower := consumerPrefix(consumer, false)
		it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: prefixEnd(lower)})
		if err != nil {
			return nil, unavailable("iterate records", err)
		}
		var u storage.Usage
		for ok := it.First(); ok; ok = it.Next() {
			v, err := it.ValueAndErr()
			if err == nil {
				err = decodeRecord(v, &rec)
			}
			if err != nil {
				_ = it.Close()
				return nil, unavailable("read record", err)
			}
			if !rec.Live(now) {
				continue
			}
			// The key is the encoded one less the prefix and the kind byte.
			rec.Consumer, rec.Key.Key = consumer, string(it.Key()[len(lower)+1:])
			u.Records++
			u.Bytes += storage.RecordBytes(&rec)
		}
		if err := it.Close(); err != nil {
			return nil, unavailable("iterate records", err)
		}
		out[consumer] = u
	}
	return out, nil
}
