-- CockroachDB's form of 0006_parking.sql: CockroachDB names the state check
-- of 0001_records.sql check_state where PostgreSQL names it
-- idemreg_records_state_check, so both names are dropped before the check
-- is created again. Not run against a cluster here (docs/testing.md).
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS park_reason TEXT NOT NULL DEFAULT '';
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS max_attempts BIGINT NOT NULL DEFAULT 0;
ALTER TABLE idemreg_records DROP CONSTRAINT IF EXISTS check_state;
ALTER TABLE idemreg_records DROP CONSTRAINT IF EXISTS idemreg_records_state_check;
ALTER TABLE idemreg_records ADD CONSTRAINT idemreg_records_state_check CHECK (state IN (1, 2, 3));
