// Package server serves idemreg.v1.RegistryService and AdminService on a
// storage.Store: it admits each request (authentication, authorisation,
// limits), validates it against Limits and the consumer's policy, decides it
// through the store, and translates what the store answered into a gRPC
// status, once (status.go).
//
// The files of this package are the path of a request; what runs below the
// handlers lives in server/internal/*, packages that cannot reach back up
// (docs/design.md draws the layers). This map names every file and
// package: TestDocMap fails when one is added, renamed or removed without
// it.
//
// Setting up, before the first call:
//
//   - config.go: Config, its defaults and its validation (StaticWindow:
//     fixed HTTP/2 windows, which a client asks for too with
//     client.DialOptions, client/dial.go; Replica, this replica's place
//     among those sharing the store); limits.go: Limits, the bounds a
//     request must respect and the defaults it gets, and Bounds, what a
//     peer may make the server hold; tlsfiles.go: the TLS configuration
//     on PEM files, re-read when they rotate;
//   - server.go: New builds the grpc.Server (the interceptor chain below,
//     health and reflection), Serve runs it and drains it;
//     inprocess.go: a connection only this process can open, on which
//     the console of the same binary acts as its signed-in operator;
//   - server/internal/admission enforces Bounds: the connections of each
//     listener, the calls waiting for their request, the streams without
//     credentials, each identity's calls in progress, and the memory
//     guard that refuses Claims near the memory limit;
//   - server/internal/replicas is this replica among those sharing the
//     store: their membership (server/internal/membership), from which the
//     rate limits and quotas take this replica's share, and the link to
//     the others, told when a key a Claim waits on there ends
//     (server/internal/peers).
//
// One Claim, in order:
//
//   - the listener's tap (server/internal/admission) refuses a call beyond
//     MaxPendingCalls before gRPC reads it;
//   - codec.go: the request is received (a unary method is carried as a
//     client stream, so that a call with no message, or two, is the
//     server's to refuse) and decoded; one that does not decode is kept
//     and refused after authentication;
//   - otelgrpc's stats handler opens the span and measures the call,
//     accesslog.go's writes the line per finished call and sets the
//     span's attributes (consumer, kind, identity, outcome) when it is
//     sampled;
//   - the unary chain (chain.go, in order): recovery; the request's
//     budget (chain.go); refusals.go (a refusal by what follows, beyond
//     its caller's budget, held before it is answered); authn.go (the
//     caller's identity from a bearer token or a client certificate);
//     codec.go's refusal of the malformed; authz.go (may the identity use
//     the consumer?); calls in progress per identity
//     (server/internal/admission);
//     ratelimit.go (the identity's and the consumer's token buckets). For
//     a batch, authz.go and ratelimit.go judge each item (batchitems.go)
//     instead of refusing the call;
//   - service.go: the RegistryService handlers. Claim validates
//     (validate.go), refuses to start work near the memory limit
//     (server/internal/admission), reads the claim key (server/internal/claimsecret),
//     admits the Claim under the consumer's quota (server/internal/quota),
//     decides it through the store chain (server/internal/storechain: the
//     deadline margin, the in-flight bounds and the store's measures in one
//     place), waiting for a key in progress when asked (wait.go,
//     server/internal/waiting), and answers with the record (convert.go)
//     and the claim secret;
//   - batch.go: BatchClaim, BatchComplete and Batch, the same per item,
//     every item that passed decided in one store call;
//   - admin.go: the AdminService (and ListRecords' validation, its page
//     tokens in server/internal/pagetoken); backup.go: its backup RPCs, a
//     copy of the embedded store's files taken from the backend itself;
//   - status.go: every error of the store, the context or the server's own
//     refusals becomes one status with its reason and details, by the one
//     classification of server/internal/reason (which also bounds what a
//     status or a log line echoes of a request);
//   - health.go, parked.go, metrics.go: health and readiness, the parked
//     records gauge, and the instruments the steps above record to.
//
// Beside the request path, read by it and by the binary: server/access
// (identities, grants, rate limits), server/policy (per-consumer lease,
// retention and quota), server/configfile (the config file as one parse,
// reloaded whole), server/resulttype (the response types a resolution is
// checked against); server/servertest starts a real server for tests.
package server
