package postgres

import (
	"context"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.UsageCounter = (*Store)(nil)

// usageSQL: $1 consumers, $2 clock offset µs. consumer = ANY($1) is a
// range of the primary key (consumer, kind, key) per consumer, so the
// statement reads the rows of the consumers asked about and no other; it
// reads all of them, expired or not (expiry is not indexed per consumer),
// which is why the server runs it every --quota-refresh and not per Claim.
// The byte sum is storage.RecordBytes: octet_length of TEXT is its UTF-8
// length, as Go's len. Sums are cast because CockroachDB sums integers as
// DECIMAL. It is rare, so it is not prepared on every connection.
var usageSQL = `
WITH clock AS (
    SELECT now() + CAST($2 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
SELECT r.consumer, CAST(count(*) AS BIGINT),
       CAST(COALESCE(sum(octet_length(r.consumer) + octet_length(r.key) + octet_length(r.fingerprint)
           + octet_length(r.holder) + octet_length(r.request_id) + octet_length(r.park_reason) + COALESCE(octet_length(r.result), 0)), 0) AS BIGINT)
FROM idemreg_records r CROSS JOIN clock c
WHERE r.consumer = ANY(CAST($1 AS TEXT[])) AND ` + live("r", "c.now") + `
GROUP BY r.consumer`

// ConsumerUsage counts the live records of consumers and their bytes in
// one statement.
func (s *Store) ConsumerUsage(ctx context.Context, consumers []string) (map[string]storage.Usage, error) {
	out := make(map[string]storage.Usage, len(consumers))
	if len(consumers) == 0 {
		return out, nil
	}
	err := s.run(ctx, "usage", func(ctx context.Context) error {
		clear(out)
		rows, err := s.pool.Query(ctx, usageSQL, consumers, s.offsetMicros())
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				consumer string
				u        storage.Usage
			)
			if err := rows.Scan(&consumer, &u.Records, &u.Bytes); err != nil {
				return err
			}
			out[consumer] = u
		}
		return rows.Err()
	})
	if err != nil {
		return nil, err
	}
	for _, c := range consumers {
		if _, ok := out[c]; !ok {
			out[c] = storage.Usage{}
		}
	}
	return out, nil
}
