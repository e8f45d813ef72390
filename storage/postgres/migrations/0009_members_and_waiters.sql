-- The replicas sharing the database (storage.Membership): a row per
-- running replica, with the address its peers reach it on and the
-- database's clock at its first and last heartbeat. Liveness is judged by
-- the database's clock alone (heartbeat_at against now()), so the
-- replicas' clocks may differ. Rows of replicas that stopped
-- heartbeating are deleted by the others' heartbeats.
CREATE TABLE IF NOT EXISTS idemreg_members (
    id           TEXT        NOT NULL PRIMARY KEY,
    address      TEXT        NOT NULL,
    joined_at    TIMESTAMPTZ NOT NULL,
    heartbeat_at TIMESTAMPTZ NOT NULL
);
-- The replicas holding a Claim that waits for the record's current
-- attempt to end (storage.WaitMarker): NULL while nobody waits, which is
-- almost always. The statements that end an attempt return it, so that
-- the replica ending it tells the waiting ones at once (docs/design.md,
-- "Waits across replicas"); a Claim that acquires the record clears it.
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS waiters TEXT[];
