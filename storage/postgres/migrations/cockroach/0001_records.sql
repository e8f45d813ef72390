-- CockroachDB variant of ../0001_records.sql: the same table with a
-- hash-sharded primary key. Keys within a consumer are often sequential
-- (offsets, ULIDs, timestamps), which sends every new record of that
-- consumer to the end of one range: a hotspot that load-based splitting
-- cannot fix, since every write lands past the split point. USING HASH
-- prefixes the key with a computed shard (a hidden crdb_internal column),
-- so that sequential keys spread over the buckets' ranges; point lookups
-- by the full key compute the shard and still read one row. Range scans by
-- consumer (usage, admin) fan out over the buckets. Needs v22.1+, where a
-- hash-sharded key can arbitrate ON CONFLICT (consumer, kind, key)
-- (cockroachdb/cockroach#60829).
--
-- A primary key cannot be changed cheaply once the table holds data, so
-- this file only shapes new clusters: a cluster that ran the base 0001
-- already has it recorded and keeps its key (docs/cockroachdb.md, "Choosing
-- the primary key", has the online ALTER PRIMARY KEY and its cost).
CREATE TABLE IF NOT EXISTS idemreg_records (
    consumer         TEXT        NOT NULL,
    kind             SMALLINT    NOT NULL,
    key              TEXT        NOT NULL,
    state            SMALLINT    NOT NULL CHECK (state IN (1, 2)),
    fingerprint      BYTEA       NOT NULL,
    token            BIGINT      NOT NULL,
    attempt          BIGINT      NOT NULL,
    holder           TEXT        NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL,
    lease_expires_at TIMESTAMPTZ NOT NULL,
    completed_at     TIMESTAMPTZ NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
    retention_us     BIGINT      NOT NULL,
    result           BYTEA       NULL,
    PRIMARY KEY (consumer, kind, key) USING HASH
);
