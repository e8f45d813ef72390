-- The claim keys by generation (storage.ClaimKeys), so that the key can be
-- rotated while servers run: a rotation adds a generation, current from
-- active_from on, and gives the one it replaces an accept_until (NULL
-- while a key is the newest). Generation 1 is idemreg_secrets' 'claim'
-- row, which servers before versioned keys read: it is copied in on first
-- use, so that both agree until the first rotation. Never sent to callers.
CREATE TABLE IF NOT EXISTS idemreg_claim_keys (
    generation   BIGINT      NOT NULL PRIMARY KEY,
    value        BYTEA       NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    active_from  TIMESTAMPTZ NOT NULL,
    accept_until TIMESTAMPTZ
);
