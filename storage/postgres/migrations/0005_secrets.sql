-- Secrets the registry keeps for itself, by name. 'claim' is the key the
-- server derives each claim's secret from (storage.ClaimKeys): created by
-- the first server that needs it, then shared by every server on this
-- database. Never sent to callers.
CREATE TABLE IF NOT EXISTS idemreg_secrets (
    name       TEXT        NOT NULL PRIMARY KEY,
    value      BYTEA       NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
