-- Opt-in (idemreg migrate --cockroach-ttl), CockroachDB only: the cluster
-- deletes expired records itself with row-level TTL, in place of
-- `idemreg sweep` and serve's sweeper, which must then be off (serve turns
-- its own off when it finds this migration applied). The TTL job deletes
-- rows whose expires_at has passed by the cluster's clock, the sweeper's
-- condition, and re-checks it in its delete, so a record claimed again
-- meanwhile is kept. docs/retention.md says when to prefer it.
-- To undo: ALTER TABLE idemreg_records RESET (ttl); then recreate the
-- expires_at index (../cockroach/0002_expires_at_index.sql) before any
-- sweeper runs.
ALTER TABLE idemreg_records SET (
    ttl_expiration_expression = 'expires_at',
    ttl_job_cron = '*/10 * * * *',
    ttl_select_batch_size = 500,
    ttl_delete_batch_size = 100,
    -- Rows per second per node; bounds the impact on live traffic.
    ttl_delete_rate_limit = 2000,
    ttl_pause = false
);
