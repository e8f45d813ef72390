// Package client is the Go client of the idemreg registry. It owns three
// things:
//
//   - a typed client ([New]) over the generated RegistryService stub whose
//     errors are rebuilt from the status details, so callers write
//     errors.Is(err, client.ErrFingerprintMismatch) or
//     errors.As(err, &unavailable) instead of parsing codes;
//   - [Client.Once], the helper for inbox-style message consumers: claim the
//     message id, run the handler with the fencing token, record the outcome,
//     replay it to every duplicate; [Client.OnceBatch], the same for a
//     fetched batch in one BatchClaim and one BatchComplete;
//   - [UnaryClientInterceptor] and [UnaryServerInterceptor], which make an
//     outgoing call, or a service's own RPC, run once per idempotency key,
//     and their stream counterparts, which refuse keyed streaming calls.
//
// The package imports gRPC, protobuf, the genproto error details and the
// generated idemreg API, and nothing else outside the standard library: a
// service that adds the interceptor pulls in no database driver and none of
// the registry's server code. (Tests that need a running registry use the
// opt-in package client/registrytest.)
//
// # What the registry does and does not guarantee
//
// The registry gives each key one owner at a time and replays the stored
// outcome of a completed key for its retention. It makes duplicates visible;
// it prevents a duplicate effect only where the handler cooperates: fence
// writes with the token, forward the idempotency key to a provider that
// honours it, or record the message id in the same local transaction as the
// effect. Package client/fence does the first in the caller's own
// transaction, with the standard library's database/sql only.
// docs/client.md says how to choose keys and what each helper guarantees.
//
// Once, OnceBatch and both interceptors run claimed work through one
// runner (heartbeat, release after a panic, recording), and take options
// typed by what reads them ([OnceOption], [BatchOption],
// [InterceptorOption]; [SharedOption] is all three), so an option an entry
// point does not read does not compile there.
//
// # Streaming
//
// Streaming RPCs are never claimed, replayed or de-duplicated. So that no
// keyed streaming call runs twice without saying so, the unary
// interceptors refuse (panic) to be built with a streaming method in
// WithMethods, [StreamServerInterceptor] and [StreamClientInterceptor]
// refuse keyed streaming calls, and a unary interceptor without them logs
// once per service which streaming methods go unguarded.
package client

// The path of a call, file by file (for readers of the code; users need
// only the documentation above):
//
//   - once.go: the entry points Once and OnceBatch (the Consumer in
//     consumer.go, the interceptors in interceptor.go and
//     server_interceptor.go start the same way);
//   - claim.go: the Claim, repeated under one request id when its answer
//     was lost, and repeated while it waits for another holder; OnceBatch's
//     rounds of BatchClaims and its duplicate ids;
//   - coalesce.go: how each Claim and Complete goes out, decided in one
//     place (route: alone, or through the queue that shares a Batch RPC),
//     and the batch RPCs (Batch, BatchClaim, BatchComplete);
//   - lifecycle.go: what follows an acquired claim: the heartbeat that
//     extends it, the work, and its outcome recorded (Complete of a result
//     or a final failure, Release after a retryable failure or a panic, or
//     of a claim its caller gave up on);
//   - backoff.go: the one backoff every repeat and wait sleeps through.
//
// client.go is the typed client (one method per RPC), options.go the
// options, errors.go and answers.go the typed errors and the interceptors'
// statuses.
