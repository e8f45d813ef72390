-- The sweeper deletes the oldest expired records first.
-- CockroachDB runs cockroach/0002_expires_at_index.sql in place of this file.
CREATE INDEX IF NOT EXISTS idemreg_records_expires_at ON idemreg_records (expires_at);
