// Package postgres is the SQL storage backend: storage.Store,
// storage.Sweeper and storage.Admin on PostgreSQL or CockroachDB, through
// pgx, with the schema and its migrations (Migrate).
//
// # One statement per call
//
// Every call is one SQL statement, run as its own implicit transaction, in
// one round trip (shared with other calls when they coalesce, below): the statements are prepared on each new connection, so a
// call is a single Bind/Execute exchange from its first use. A writing call
// is a conditional INSERT ... ON CONFLICT DO UPDATE ... WHERE (Claim) or
// UPDATE ... WHERE (Complete, Release, Extend) in a data-modifying CTE,
// followed in the same statement by a read of the row as it was (the
// pre-image) which is returned only for the keys nothing was written for;
// a Claim reads the row first and attempts the insert only when that read
// does not decide the answer on its own, so replays and in-progress
// answers lock nothing. The write conditions are those of storage/rules.go,
// built from SQL fragments named after the rules (queries.go), and one
// template makes both the single-row and the batched form of a statement; an answer that was not written is
// classified by handing the pre-image to the same storage.Decide* function
// the embedded store uses, so the two backends cannot drift apart
// silently: if that function says it would have written, the row changed
// after the statement's snapshot and the statement runs again (see
// Isolation); a disagreement that outlasts the retries fails the call and
// is logged as an error. There is no read-then-write window, and the
// database's clock (now(), plus the clock offset tests inject) is the only
// clock: service replicas' clocks never decide a lease or an expiry.
//
// Two costs sit outside that one round trip: a new connection prepares the
// statements (one exchange each, once per connection), and pgxpool pings a
// connection that sat idle for over a second before handing it out (pgx's
// default, kept because it spares a call failing on a connection the server
// or a balancer closed while idle; WithPoolConfig can change ShouldPing).
// Named prepared statements need a direct connection or a pooler that
// tracks them (PgBouncer 1.21+ with max_prepared_statements).
//
// # Coalescing
//
// One statement per call costs one commit per call, and commits, not rows,
// bound a small machine: so concurrent Claims and Completes that arrive
// together travel as one transaction: the Claims as one multi-row statement
// and the Completes as another of the same shape (claimBatchSQL,
// completeBatchSQL), pipelined in one pgx.Batch under one Sync, which
// PostgreSQL and CockroachDB run as one implicit transaction: one round
// trip and one commit for the whole batch, and every caller still gets the
// answer for its own key, classified by the same Decide function. Both
// kinds share one queue, so the batches are twice the size two queues
// would make (about half of a service's calls are Completes). A call that
// finds the queue's statement slot free (WithBatching; one by default),
// nobody queued and its key idle runs alone with the single-row statement,
// so a lone caller's latency is unchanged. Otherwise it joins the pending
// batch, sent when the slot frees, when it is full, or when its window has
// passed. An explicit batch (ClaimBatch, CompleteBatch, Batch: the
// server's BatchClaim, BatchComplete and Batch) joins the same pending
// batch with all its items at once.
//
// A key appears at most once in a transaction (PostgreSQL refuses an ON
// CONFLICT DO UPDATE that affects a row twice): a key is busy from the
// moment its item is queued until its answer is final, and a later item on
// it waits, in order, for a later transaction; so a caller's Complete and
// then Claim of one key are decided in that order. A batch that hits a
// serialization failure or a deadlock is split in halves and retried;
// single items left over run alone with their own retries. batch.go has
// the details.
//
// A batch the database refuses because of one member's input (SQLSTATE
// class 22, 23 or 54: a NUL byte in a text value, say) is split the same
// way, without a pause, so that only that member fails. A batch carries at
// most DefaultBatchBytes (8 MiB) of parameters: CockroachDB refuses a
// pgwire message over 16 MiB.
//
// # Isolation
//
// PostgreSQL sessions run at READ COMMITTED, CockroachDB sessions at
// SERIALIZABLE (set on each new connection whatever the role's default).
// Each call is one statement, so the question is only what one statement
// sees; at READ COMMITTED on PostgreSQL:
//
//   - The conditional write decides on the latest committed row, under its
//     row lock. INSERT ... ON CONFLICT DO UPDATE locks the conflicting row,
//     waiting for a concurrent writer, and evaluates its WHERE on the
//     latest version, even one the statement's snapshot does not show; an
//     UPDATE re-evaluates its WHERE on the latest version of a row that
//     changed since the snapshot (EvalPlanQual). So a write is made only
//     where the rules allow it on the row as it is when written, with the
//     statement's clock: the same write SERIALIZABLE would make.
//   - The pre-image is read from the statement's snapshot, taken when the
//     statement starts, within the call. An answer classified from it
//     without a write is the answer at that instant: linearizable.
//   - The one new case is a declined write whose snapshot is older than
//     the row the write saw: a concurrent writer committed in between. The
//     pre-image then does not explain the refusal (the rules would have
//     written it, or there is no pre-image at all) and the store runs the
//     statement again, which then sees the newer row (Store.decided; a
//     batch member runs again alone). SERIALIZABLE aborts the same race
//     with 40001 and the statement runs again as well.
//   - The sweeper's DELETE repeats its expiry predicate on the row itself,
//     so a record re-claimed or extended after the inner SELECT read it is
//     re-checked on its latest version and kept.
//
// TestStalePreImageRunsAgain makes that race happen for Claim, Complete,
// Extend and Release; the conformance suite's races (one owner among
// concurrent Claims, takeover against Complete, stale tokens, sweeping
// against Claims) and the linearizability runs under faults run at READ
// COMMITTED too. What it saves: SERIALIZABLE takes predicate locks on the
// index pages each statement reads, and Claims of new keys next to each
// other in the index then abort each other; at 64 callers without
// coalescing that cost 715 pairs/s and 804 µs of database CPU per call
// against 1,922 and 272 at READ COMMITTED (docs/benchmarks.md).
// CockroachDB keeps SERIALIZABLE: its READ COMMITTED is a different
// implementation whose conflict handling has not been checked here.
//
// # Retries
//
// A statement that fails with a serialization failure (40001, or CR000 from
// old CockroachDB) or a PostgreSQL deadlock (40P01) was rolled back, and is
// run again whole (crdb.ExecuteCtx), after a jittered exponential pause, at
// most WithMaxRetries times and never past the context's deadline. Even a
// single INSERT ... ON CONFLICT gets 40001 on PostgreSQL when it races an
// insert of the same key, so single statements need the loop too. Errors
// are wrapped with %w throughout so the SQLSTATE reaches the classifier and
// the logs. A caller whose context ended gets an error matching ctx.Err();
// every other failure wraps storage.ErrUnavailable and its cause, but
// SQLSTATE class 53 (disk full, out of memory, too many connections), which
// is a *storage.ExhaustedError naming the resource. Failures
// that may have committed (a connection lost during the statement) are not
// retried here; every call is safe to repeat (a repeated Complete with the
// same token returns the stored record), and the caller decides.
//
// # Why not crdbpgx.ExecuteTx
//
// cockroach-go's ExecuteTx runs the transaction inside SAVEPOINT
// cockroach_restart and takes RELEASE SAVEPOINT for the commit. That is the
// commit on CockroachDB, but not on PostgreSQL, where it ignores the error
// of the real COMMIT: a serialization failure there becomes a silently lost
// write. Savepoint retries also never succeed on PostgreSQL (the snapshot
// survives ROLLBACK TO SAVEPOINT). Retrying the whole statement serves both
// databases, and with one statement per call there is no transaction to
// manage.
//
// # History and listing
//
// A record's History is a JSONB array in its row (migration 0007): the
// statements that end an attempt (a Claim's takeover, Invalidate, Resolve)
// append to it with the fragments appendHistory and ended (queries.go),
// named after the rules' functions, and none of them returns it, so that
// their answers stay small; only Inspect and List read it.
//
// List is a keyset scan: one statement reads at most
// storage.ListScanLimit(Limit) entries of one index in key order after the
// page's starting key (a row comparison on (consumer, kind, key), which
// both databases turn into the start of an index range), keeps those that
// match the filters, and returns up to Limit of them. Next is the last
// record returned when the page is full, else the last entry read when the
// window was read whole, else nil: the range is over. Each page is one
// snapshot; a listing is not, but every record that exists throughout it
// is listed exactly once. A listing of parked records reads the partial
// index idemreg_records_parked (WHERE state = 3), and so does CountParked;
// each variant of the statement is its own text, with the predicate
// written out, because a prepared statement's generic plan can only use
// a partial index whose predicate the text itself implies (TestListPlans).
//
// A prefix listing reads the primary key range [prefix, prefixEnd(prefix)),
// which holds exactly the consumers starting with prefix in code point
// order. CockroachDB always orders strings so; PostgreSQL does under a C or
// C.UTF-8 collation, which the database must be created with (CREATE
// DATABASE ... LOCALE 'C.UTF-8' TEMPLATE template0; the tests' server
// uses it). Under a linguistic collation such as en_US.UTF-8 a prefix
// listing or count may miss consumers or include others, and every listing
// comes in that collation's order rather than the one storage.Admin
// documents; listing one consumer is still complete.
//
// # CockroachDB
//
// The SQL is the subset both databases accept (BIGINT, no sequences,
// triggers, functions, UPSERT or xmax tricks); CockroachDB-only DDL lives in
// migrations/cockroach and replaces the base file of the same name there:
// the hash-sharded primary key (sequential keys within a consumer would
// otherwise append to one range) and the hash-sharded index on expires_at,
// which would otherwise be a write hotspot. Each call is one statement
// from the client, but not a one-phase commit there: CockroachDB commits
// in one phase only a mutation at the root of the plan whose writes sit in
// one range, and here the mutation sits in a CTE and a write also updates
// the row's expires_at index entry, usually in another range. Each write is
// then a distributed (parallel) commit with intents to resolve, and readers
// of the key wait on them. The row-level TTL variant (WithRowLevelTTL)
// drops that index, so a write touches one range. docs/cockroachdb.md has
// the cost model and what to measure on a cluster. Answers are
// kept small because CockroachDB retries an implicit transaction
// server-side only while its result is buffered (16 KiB by default): a
// written Complete does not send the result back, and only replays and
// repeated Completes carry one. Larger answers that conflict get 40001 at
// the client and are retried by the loop above (batches split first). The
// sweeper starts its scans at a cursor (sweep.go) so that it does not read
// again the tombstones CockroachDB keeps for gc.ttlseconds. The
// conformance suite runs against a cluster when
// IDEMREG_TEST_COCKROACH_URL is set.
//
// # Files
//
//   - store.go: Open, the pool and each connection's session (isolation,
//     generic plans, prepared statements), the record operations, the
//     waiters' marks (storage.WaitMarker) and SweepExpired;
//   - queries.go: the whole of the store's SQL, each statement one template
//     for its single-row and batched forms, built from fragments named
//     after storage/rules.go;
//   - batch.go: the one queue that coalesces Claims and Completes into one
//     transaction (storage.MixedBatcher), and its splitting on failure;
//   - retry.go: the SQLSTATEs retried and the retry loop;
//   - options.go: the Store's options and their defaults;
//   - admin.go: storage.Admin (inspect, list, resolve, invalidate, parked
//     counts); usage.go: storage.UsageCounter, the quotas' counts;
//   - membership.go: storage.Membership, the replicas' heartbeat rows;
//   - secrets.go: the claim key's generations (storage.ClaimKeys);
//   - sweep.go: the sweep cursor, so that a sweep does not read again the
//     tombstones it left;
//   - migrate.go: Migrate and the embedded migrations, under a lock row;
//   - metrics.go: the store's instruments; redact.go: Redact, a connection
//     string's secrets taken out of everything printed or returned;
//   - pgtest/: a fresh database per test.
package postgres
