-- storage.Record.Lease in microseconds: the length of the current lease,
-- as the Claim that acquired it or the last Extend set it; an Extend
-- without a lease extends by it. 0 for rows written before this column.
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS lease_us BIGINT NOT NULL DEFAULT 0;
