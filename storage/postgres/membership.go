package postgres

import (
	"context"
	"time"

	"github.com/idemreg/idemreg/storage"
)

var _ storage.Membership = (*Store)(nil)

// The membership's statements. A heartbeat is one upsert and, when dead
// rows are to go, one delete: CockroachDB refuses two modifications of one
// table in one statement. Both run once a heartbeat interval per replica,
// so they are not prepared on every connection.
const (
	// heartbeatSQL: $1 id, $2 address, $3 clock offset µs.
	heartbeatSQL = `
INSERT INTO idemreg_members AS m (id, address, joined_at, heartbeat_at)
VALUES ($1, $2, now() + CAST($3 AS BIGINT) * INTERVAL '1 microsecond', now() + CAST($3 AS BIGINT) * INTERVAL '1 microsecond')
ON CONFLICT (id) DO UPDATE SET address = excluded.address, heartbeat_at = excluded.heartbeat_at`
	// removeDeadSQL: $1 id (never deleted), $2 age µs, $3 clock offset µs.
	removeDeadSQL = `
DELETE FROM idemreg_members
WHERE id <> $1
  AND heartbeat_at < now() + CAST($3 AS BIGINT) * INTERVAL '1 microsecond' - CAST($2 AS BIGINT) * INTERVAL '1 microsecond'`
	// membersSQL: $1 live for µs, $2 clock offset µs. The clock column
	// comes from a one-row CTE joined on the left, so that an empty table
	// still answers the clock.
	membersSQL = `
WITH clock AS (
    SELECT now() + CAST($2 AS BIGINT) * INTERVAL '1 microsecond' AS now
)
SELECT c.now, m.id, m.address, m.joined_at, m.heartbeat_at
FROM clock c LEFT JOIN idemreg_members m
  ON m.heartbeat_at > c.now - CAST($1 AS BIGINT) * INTERVAL '1 microsecond'
ORDER BY m.id`
	// leaveSQL: $1 id.
	leaveSQL = `DELETE FROM idemreg_members WHERE id = $1`
)

// Heartbeat implements storage.Membership.
func (s *Store) Heartbeat(ctx context.Context, p storage.HeartbeatParams) error {
	return s.run(ctx, "heartbeat", func(ctx context.Context) error {
		if _, err := s.pool.Exec(ctx, heartbeatSQL, p.ID, p.Address, s.offsetMicros()); err != nil {
			return err
		}
		if p.RemoveAfter <= 0 {
			return nil
		}
		_, err := s.pool.Exec(ctx, removeDeadSQL, p.ID, p.RemoveAfter.Microseconds(), s.offsetMicros())
		return err
	})
}

// Members implements storage.Membership.
func (s *Store) Members(ctx context.Context, liveFor time.Duration) (storage.MemberList, error) {
	var out storage.MemberList
	err := s.run(ctx, "members", func(ctx context.Context) error {
		out = storage.MemberList{}
		rows, err := s.pool.Query(ctx, membersSQL, liveFor.Microseconds(), s.offsetMicros())
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				id, addr          *string
				joined, heartbeat *time.Time
			)
			if err := rows.Scan(&out.Now, &id, &addr, &joined, &heartbeat); err != nil {
				return err
			}
			if id == nil {
				continue // no live member: the clock's row alone
			}
			out.Members = append(out.Members, storage.Member{ID: *id, Address: *addr, JoinedAt: joined.UTC(), HeartbeatAt: heartbeat.UTC()})
		}
		return rows.Err()
	})
	out.Now = out.Now.UTC()
	return out, err
}

// Leave implements storage.Membership.
func (s *Store) Leave(ctx context.Context, id string) error {
	return s.run(ctx, "leave", func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, leaveSQL, id)
		return err
	})
}
