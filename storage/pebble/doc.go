// Package pebble is idemreg's embedded durable store: `idemreg serve` with
// a data directory and nothing else to set up. It keeps records in a Pebble
// database in that directory and decides every call with the registry's
// state machine (storage.DecideClaim and the others), so it answers exactly
// as the SQL store does.
//
// # Decisions and durability
//
// A call takes its key's lock (one of a fixed array of mutexes, hashed by
// key), reads the record, decides with the clock reading and, when the
// decision writes, commits the new record in a batch synced to the WAL before
// it returns: whatever a call reported is on disk. Calls on different keys
// never wait for each other's sync; Pebble's WAL gathers the syncs of
// concurrent batches into one fsync (group commit), which is where the
// throughput comes from. Times are kept in UTC, truncated to microseconds,
// as a SQL store returns them.
//
// Memory: a block cache of DefaultCacheSize (WithCacheSize), so claims of
// new keys, which look for a record that is not there, rarely read the disk,
// and memtables of up to 32 MiB, which Pebble grows to from a small start.
//
// # Key layout
//
//	0x00 "format"             layout version (2)
//	0x00 "token-floor"        greatest token of any record the sweeper deleted
//	0x00 "claim-key"          the claim key (storage.ClaimKeys)
//	0x00 "restore-floor"      the greatest token issued before a restore
//	                          (restore.go); absent if never restored
//	0x01 consumer 0x00 0x01 kind key
//	                          a record; 0x00 in the consumer is written
//	                          0x00 0xFF, so the key is unambiguous and sorts
//	                          by (consumer, kind, key)
//	0x02 expires_at record-key
//	                          the expiry index: expires_at in big-endian
//	                          microseconds, one entry per record
//	0x03 record-key           the parked index: one entry per record in
//	                          StateParked, its value the record's expires_at
//
// A record value is a version byte followed by a compact binary encoding
// (varints, length-prefixed bytes, the history of ended attempts, the result
// last); each version adds fields after the last one's, and a record is
// written in the oldest version that holds what it has (encoding.go).
// Every write moves the record's index entries in the same batch, so
// SweepExpired walks expiries oldest first, touching only what it may
// delete, OldestExpiry reads a single entry, and a listing or count of
// parked records (List with StateParked, CountParked) reads the parked
// index, never the records around them.
//
// Other listings walk a consumer's, or a prefix's, record keys: escaping is
// byte by byte, so the consumers that start with a prefix are one range.
// A page reads at most storage.ListScanLimit entries and takes the records
// it returns again under their key locks.
//
// Layout version 1 had no parked index. Open builds it in a version 1
// directory, reading every record once, and stamps version 2 in the same
// synced batch as the last entries; a binary of version 1 refuses the
// directory from then on, since it would park records without indexing
// them.
//
// # Tokens
//
// storage.NextToken keeps a key's tokens increasing across the deletion of
// its record by never issuing a token below the clock, which holds as long
// as the clock does not step back by more than the shortest retention. This
// store does not rely on that: each sweep raises a persisted token floor to
// the greatest token it deleted, and a claim of a key with no record presents
// the floor to DecideClaim as the expired record's token, so tokens keep
// increasing across deletions and restarts whatever the wall clock does. It
// costs nothing on the hot path.
//
// A restore from a backup (Restore) persists a restore floor: the greatest
// of the backup's token high-water mark, the greatest token of the
// directory it replaces, and the restore's clock. The store's clock never
// reads below it, so every token issued after the restore, by any decision,
// exceeds every token issued before it on either timeline; a token the lost
// timeline issued ahead of the restore's clock, in a directory the restore
// did not replace, is the one case left to the clock.
//
// # Backups
//
// BeginBackup takes a pebble checkpoint in a directory inside the data
// directory (checkpoint.go): hard links to the sstables and a copy of the
// WAL, consistent at one point of the WAL, so every call acknowledged
// before it is in it. Open removes checkpoints a stopped process left.
//
// # The directory lock
//
// Open takes an exclusive flock on idemreg.lock in the directory and fails
// with ErrLocked, naming the directory, while another Store holds it. Pebble's
// own LOCK is an fcntl lock, which does not conflict within one process; the
// flock does, and the kernel drops it when its process dies.
//
// # Why Pebble
//
// Pebble is the storage engine of CockroachDB: an LSM tree written in pure
// Go (no cgo, so the binary stays static and cross-compiles), heavily tested
// for crash safety, with a WAL that group-commits concurrent synced batches.
// A registry's load is many small durable writes from many callers at once,
// which is what that WAL is built for.
package pebble
