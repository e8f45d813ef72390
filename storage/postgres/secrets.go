package postgres

import (
	"context"
	"crypto/rand"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemreg/idemreg/storage"
)

// legacyClaimKeySQL inserts the candidate key unless a key exists and
// returns the stored one: idemreg_secrets' 'claim' row, which servers
// before versioned keys read. The no-op update makes RETURNING give the
// existing row, and a concurrent first insert is waited for, so every
// server gets one key.
const legacyClaimKeySQL = `
INSERT INTO idemreg_secrets (name, value) VALUES ('claim', $1)
ON CONFLICT (name) DO UPDATE SET value = idemreg_secrets.value
RETURNING value`

// firstClaimKeySQL makes the legacy key generation 1: $1 key, $2 clock
// offset µs. A concurrent first call's insert wins; both read it after.
var firstClaimKeySQL = `
INSERT INTO idemreg_claim_keys (generation, value, active_from)
VALUES (1, $1, now() + ` + micros("CAST($2 AS BIGINT)") + `)
ON CONFLICT (generation) DO NOTHING`

// claimKeyRingSQL reads the generations still accepted, newest first, and
// the clock: $1 clock offset µs. The left join gives one row with a NULL
// generation when there is none, so the clock always comes back.
var claimKeyRingSQL = `
WITH ` + clock(1) + `
SELECT k.generation, k.value, k.active_from, k.accept_until, clock.now
FROM clock LEFT JOIN idemreg_claim_keys k
    ON k.accept_until IS NULL OR k.accept_until > clock.now
ORDER BY k.generation DESC`

// The rotation, in one transaction: $1 clock offset µs, $2 activate after
// µs, $3 grace µs (retireClaimKeySQL); $1 key, $2 clock offset µs, $3
// activate after µs (addClaimKeySQL); $1 clock offset µs
// (dropClaimKeysSQL). The newest key is the only one without an
// accept_until; generations that ended are deleted.
var (
	retireClaimKeySQL = `
UPDATE idemreg_claim_keys
SET accept_until = now() + ` + micros("CAST($1 AS BIGINT) + CAST($2 AS BIGINT) + CAST($3 AS BIGINT)") + `
WHERE accept_until IS NULL`
	addClaimKeySQL = `
INSERT INTO idemreg_claim_keys (generation, value, active_from)
SELECT COALESCE(max(generation), 0) + 1, $1, now() + ` + micros("CAST($2 AS BIGINT) + CAST($3 AS BIGINT)") + `
FROM idemreg_claim_keys`
	dropClaimKeysSQL = `
DELETE FROM idemreg_claim_keys WHERE accept_until <= now() + ` + micros("CAST($1 AS BIGINT)")
)

// ClaimKeyRing implements storage.ClaimKeys.
func (s *Store) ClaimKeyRing(ctx context.Context) (storage.ClaimKeyRing, error) {
	ring, err := s.readClaimKeys(ctx, s.pool)
	if err != nil || len(ring.Keys) > 0 {
		return ring, err
	}
	// First use: generation 1 is the legacy key, created if need be.
	candidate := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(candidate) // never fails (crypto/rand)
	var key []byte
	err = s.run(ctx, "claim key", func(ctx context.Context) error {
		if err := s.pool.QueryRow(ctx, legacyClaimKeySQL, candidate).Scan(&key); err != nil {
			return err
		}
		_, err := s.pool.Exec(ctx, firstClaimKeySQL, key, s.offsetMicros())
		return err
	})
	if err != nil {
		return storage.ClaimKeyRing{}, err
	}
	ring, err = s.readClaimKeys(ctx, s.pool)
	if err == nil && len(ring.Keys) == 0 {
		err = fmt.Errorf("%w: postgres: no claim key after creating one", storage.ErrUnavailable)
	}
	return ring, err
}

// RotateClaimKey implements storage.ClaimKeys.
func (s *Store) RotateClaimKey(ctx context.Context, p storage.RotateClaimKeyParams) (storage.ClaimKeyRing, error) {
	if p.ActivateAfter < 0 || p.Grace < 0 {
		return storage.ClaimKeyRing{}, fmt.Errorf("postgres: rotate claim key: negative activation delay or grace")
	}
	if _, err := s.ClaimKeyRing(ctx); err != nil { // generation 1 first, so that the legacy key is the one replaced
		return storage.ClaimKeyRing{}, err
	}
	key := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(key) // never fails (crypto/rand)
	off, act, grace := s.offsetMicros(), p.ActivateAfter.Microseconds(), p.Grace.Microseconds()
	var ring storage.ClaimKeyRing
	err := s.run(ctx, "rotate claim key", func(ctx context.Context) error {
		return pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, retireClaimKeySQL, off, act, grace); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, addClaimKeySQL, key, off, act); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, dropClaimKeysSQL, off); err != nil {
				return err
			}
			var err error
			ring, err = s.scanClaimKeys(ctx, tx)
			return err
		})
	})
	if err != nil {
		return storage.ClaimKeyRing{}, err
	}
	return ring, nil
}

type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func (s *Store) readClaimKeys(ctx context.Context, q querier) (storage.ClaimKeyRing, error) {
	var ring storage.ClaimKeyRing
	err := s.run(ctx, "claim keys", func(ctx context.Context) error {
		var err error
		ring, err = s.scanClaimKeys(ctx, q)
		return err
	})
	return ring, err
}

func (s *Store) scanClaimKeys(ctx context.Context, q querier) (storage.ClaimKeyRing, error) {
	rows, err := q.Query(ctx, claimKeyRingSQL, s.offsetMicros())
	if err != nil {
		return storage.ClaimKeyRing{}, err
	}
	defer rows.Close()
	var ring storage.ClaimKeyRing
	for rows.Next() {
		var (
			gen          *int64
			value        []byte
			active, till *time.Time
			now          time.Time
		)
		if err := rows.Scan(&gen, &value, &active, &till, &now); err != nil {
			return storage.ClaimKeyRing{}, err
		}
		ring.Now = now.UTC()
		if gen == nil {
			continue
		}
		if len(value) != storage.ClaimKeySize {
			return storage.ClaimKeyRing{}, fmt.Errorf("%w: postgres: the stored claim key of generation %d has %d bytes, not %d",
				storage.ErrUnavailable, *gen, len(value), storage.ClaimKeySize)
		}
		k := storage.ClaimKey{Generation: *gen, Key: value, ActiveFrom: active.UTC()}
		if till != nil {
			k.AcceptUntil = till.UTC()
		}
		ring.Keys = append(ring.Keys, k)
	}
	return ring, rows.Err()
}
