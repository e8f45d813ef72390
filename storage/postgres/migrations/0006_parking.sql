-- Parking (storage.StateParked, 3): the state column takes it, a parked
-- row keeps its reason (storage.Record.ParkReason, empty unless parked),
-- and every Claim writes its max_attempts (0: none) into the row it
-- proposes, where the statement's conflict branch reads it as
-- excluded.max_attempts (queries.go, claimOnConflict). Safe to repeat: the
-- check is dropped by name if it exists and created again.
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS park_reason TEXT NOT NULL DEFAULT '';
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS max_attempts BIGINT NOT NULL DEFAULT 0;
ALTER TABLE idemreg_records DROP CONSTRAINT IF EXISTS idemreg_records_state_check;
ALTER TABLE idemreg_records ADD CONSTRAINT idemreg_records_state_check CHECK (state IN (1, 2, 3));
