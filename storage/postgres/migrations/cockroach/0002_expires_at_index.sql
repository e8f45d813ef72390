-- CockroachDB variant of ../0002_expires_at_index.sql: expires_at only grows,
-- so a plain index on it sends every insert to the same range (a write
-- hotspot). A hash-sharded index spreads them; the sweeper's
-- ORDER BY expires_at LIMIT n still reads it in order, shard by shard.
CREATE INDEX IF NOT EXISTS idemreg_records_expires_at ON idemreg_records (expires_at) USING HASH;
