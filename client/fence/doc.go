// Package fence records, in the caller's own database transaction, that a
// (consumer, key) was applied under an idemreg fencing token, and refuses
// the write when a newer token has already applied. It owns one table of
// the caller's database and the single statement that writes it.
//
// The registry cannot join a service's transaction, but its token can: the
// handler of a claimed key calls [Fence.Apply] in the transaction that makes
// the domain write, before that write, and commits only when Apply returned
// nil. The fence row and the domain write then commit or roll back
// together, and:
//
//   - a holder whose lease ran out and was taken over (a larger token
//     applied since) gets [ErrStale]: its transaction must roll back, so its
//     late write never lands, whatever it does after the takeover;
//   - a takeover of a holder that crashed after committing gets nil and
//     replaces the crashed holder's write (its token is larger);
//   - the same token applying again, after its own transaction committed,
//     gets [ErrAlreadyApplied]: the holder's own write landed, and it must
//     not write again (roll back and report success);
//   - two holders racing on one key are serialized by the fence row's lock:
//     the one with the smaller token either committed before the other
//     applied (and is replaced) or is refused.
//
// It compares with the inbox pattern (a unique (consumer, message id) row
// inserted in the same transaction, ON CONFLICT DO NOTHING): the inbox
// de-duplicates deliveries but cannot tell a stale holder from a new one,
// and does not let a takeover redo a crashed holder's write; the fence does
// both, because it orders writers by the registry's token.
//
// What it does not do: it fences only writes into the database that holds
// the fence table, in the same transaction. An email sent, a provider
// called or a message published from the handler is not made atomic with
// it (use the provider's idempotency key, or an outbox row written in the
// same transaction). It does not replace the registry: without a claim
// there is no token to fence with. Fence rows must outlive every holder
// that may still apply their key: delete them no sooner than the
// registry's retention of the key.
//
// The package uses only the standard library. [Fence.Apply] takes a
// *sql.Tx of any driver; [Fence.ApplyWith] takes any transaction that can
// run one query returning a row (a pgx.Tx behind a three-line adapter).
// The SQL is what PostgreSQL and CockroachDB both accept, with $n
// placeholders.
package fence
