package postgres

import (
	"context"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Admin = (*Store)(nil)

// invalidateSQL: $1 consumer, $2 kind, $3 key, $4 expected token (0: any),
// $5 clock offset µs. It keeps the row (see storage.DecideInvalidate): the
// row's token is what keeps the key's next token above every earlier one.
// Admin statements are rare, so they are not prepared on every connection.
var invalidateSQL = fencedStatement(5,
	single(param{1, "consumer", "TEXT"}, param{2, "kind", "SMALLINT"}, param{3, "key", "TEXT"}, param{4, "token", "BIGINT"}),
	`        state            = 1,                      -- StateInProgress
        -- a parked record is resolved: Attempt starts again from 0
        attempt          = CASE WHEN `+parked("r")+` THEN 0 ELSE r.attempt END,
        park_reason      = '',
        fingerprint      = CAST('' AS BYTEA),      -- Fingerprint = nil
        token            = `+nextToken("r.token", "c.now")+`,
        lease_expires_at = c.now,                  -- the lease ends now
        completed_at     = NULL,
        result           = NULL,
        -- ExpiresAt = max(cur.ExpiresAt, now + cur.Retention)
        expires_at       = GREATEST(r.expires_at, c.now + `+micros("r.retention_us")+`)`,
	live("r", "c.now")+" AND (i.token = 0 OR r.token = i.token)", // p.Token == 0 || cur.Token == p.Token
	recordColumnsNoResultOf("r"))

// Inspect returns the stored row, expired or not, and the database's clock.
func (s *Store) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	var a answer
	err := s.run(ctx, "inspect", func(ctx context.Context) error {
		var err error
		a, err = s.queryRecord(ctx, lookupSQL, k.Consumer, int16(k.Kind), k.Key, s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.InspectResult{}, err
	}
	if !a.found {
		return storage.InspectResult{}, storage.ErrNotFound
	}
	return storage.InspectResult{Record: a.rec, Now: a.now}, nil
}

// Invalidate decides by storage.DecideInvalidate in one statement.
func (s *Store) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	rec, err := s.fencedUpdate(ctx, "invalidate", func(a answer) (storage.Record, bool, error) {
		return storage.DecideInvalidate(a.now, a.current(), p)
	}, invalidateSQL, p.Consumer, int16(p.Kind), p.Key.Key, p.Token, s.offsetMicros())
	if err != nil {
		return storage.Record{}, err
	}
	// Only a written row succeeds (DecideInvalidate always writes a live,
	// fenced record); its fingerprint is stored as empty, as the rules
	// leave it nil.
	rec.Fingerprint = nil
	return rec, nil
}
