-- Opt-in, CockroachDB only: let the cluster delete expired records itself
-- with row-level TTL, in place of `idemreg sweep` and serve's sweeper.
-- docs/retention.md says when to prefer it. `idemreg migrate --cockroach-ttl`
-- applies the same settings, drops the expires_at index and marks the
-- database so that serve and sweep do not sweep it; this file is for a
-- hand-run that keeps the index: turn the sweepers off yourself
-- (--sweep-interval=0 on serve, no sweep CronJob).
--
-- The TTL job deletes rows whose expires_at has passed by the cluster's
-- clock, the same condition the sweeper uses, and re-checks it in its
-- delete, so a record claimed again meanwhile is kept.
ALTER TABLE idemreg_records SET (
    ttl_expiration_expression = 'expires_at',
    ttl_job_cron = '*/10 * * * *',
    ttl_select_batch_size = 500,
    ttl_delete_batch_size = 100,
    -- Rows per second per node; bounds the impact on live traffic.
    ttl_delete_rate_limit = 2000,
    ttl_pause = false
);
-- To undo: ALTER TABLE idemreg_records RESET (ttl);
