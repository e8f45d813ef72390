// Package idemhttp is net/http middleware that speaks the IETF
// Idempotency-Key header (draft-ietf-httpapi-idempotency-key-header) with
// the idemreg registry behind it. It owns the HTTP side of the draft: the
// header's syntax (a Structured Field String), the fingerprint of a request
// (method, path and query, body), the recording of a response (status, the
// headers the service chose, body) and its replay with
// Idempotent-Replayed: true, and the problem+json (RFC 9457) answers of the
// draft's error cases:
//
//   - 400 when the key is missing (WithKeyRequired) or is not a valid
//     Structured Field String;
//   - 401 when the request names no caller to scope its key by;
//   - 409 with Retry-After while the first request with the key is still
//     being processed (after waiting for its outcome, as the gRPC
//     interceptors do; WithInProgressWait(0) answers at once);
//   - 422 when the key is reused with another payload;
//   - 413 when the request body is larger than the middleware buffers
//     (WithMaxBodyBytes): it is never claimed.
//
// A key is its client's: Middleware takes a [Scope], the caller each
// request comes from ([ScopeBy]), so that one caller's key never meets
// another's, and [RegistryKey] joins the two unambiguously. [Unscoped]
// shares one key space among every caller, and is a choice made by name.
//
// The claim itself is [client.Client.Once]'s: a handler that runs holds the
// key under a lease that is extended while it runs, gets its fencing token
// from [AttemptFrom], and has its request context cancelled when the
// registry reports the lease lost; a handler that panics, or answers a
// status the service marks retryable (503 by default, see WithRetryable),
// gives the key back so a retry runs again. So does a request the handler
// refused as sent (400, 422, ...: see [DefaultRetryable]): nothing is
// recorded, and the corrected request runs with the same key.
//
// It imports the standard library and package client only.
package idemhttp
