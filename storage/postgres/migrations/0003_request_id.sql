-- storage.Record.RequestID: the request_id of the Claim that acquired the
-- current lease, empty when it sent none. A constant default adds the
-- column without rewriting the table on PostgreSQL 11+ and CockroachDB.
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS request_id TEXT NOT NULL DEFAULT '';
