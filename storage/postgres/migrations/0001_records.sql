-- The registry's records, one row per (consumer, kind, key).
--
-- Kept to the SQL that PostgreSQL and CockroachDB both accept: BIGINT (INT
-- is 32-bit on PostgreSQL), no sequences, triggers or functions. Every
-- migration must be safe to run again (IF NOT EXISTS): its bookkeeping row is
-- written in a separate transaction, so a crash between the two re-runs it.
CREATE TABLE IF NOT EXISTS idemreg_records (
    consumer         TEXT        NOT NULL,
    kind             SMALLINT    NOT NULL,
    key              TEXT        NOT NULL,
    -- storage.State: 1 in progress, 2 completed.
    state            SMALLINT    NOT NULL CHECK (state IN (1, 2)),
    -- Empty when no fingerprint was given.
    fingerprint      BYTEA       NOT NULL,
    token            BIGINT      NOT NULL,
    attempt          BIGINT      NOT NULL,
    holder           TEXT        NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL,
    lease_expires_at TIMESTAMPTZ NOT NULL,
    completed_at     TIMESTAMPTZ NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
    -- storage.Record.Retention in microseconds.
    retention_us     BIGINT      NOT NULL,
    result           BYTEA       NULL,
    PRIMARY KEY (consumer, kind, key)
);
