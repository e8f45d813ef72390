-- With row-level TTL (ttl_0001) nothing reads the expires_at index: the TTL
-- job walks the primary key. Dropping it makes a Claim or Complete a write
-- of one row in one range, with no index entry in another range to commit
-- with it. Its own file, so its own transaction: one schema change each.
DROP INDEX IF EXISTS idemreg_records@idemreg_records_expires_at;
