-- storage.Record.History: the record's last ended attempts, oldest first,
-- at most storage.MaxHistory, as a JSON array of small objects with short
-- keys (ended in queries.go writes them, historyEntry in admin.go reads
-- them). JSONB rather than a child table keeps a takeover a write of one
-- row. The constant default adds the column without rewriting the table
-- and gives every existing record an empty history.
ALTER TABLE idemreg_records ADD COLUMN IF NOT EXISTS history JSONB NOT NULL DEFAULT '[]';
-- The parked records in key order, for Admin.List with the parked state and
-- Admin.CountParked. Parked records are few, so the index stays small, and
-- only a write that parks a row, or changes or deletes a parked one, touches
-- it. A query must state the predicate itself (state = 3) for either planner
-- to use the index.
CREATE INDEX IF NOT EXISTS idemreg_records_parked ON idemreg_records (consumer, kind, key) WHERE state = 3;
