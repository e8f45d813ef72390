package idemhttp

import (
	"encoding/hex"
	"errors"
	"net/http"
)

// MaxKeyBytes bounds an Idempotency-Key: the registry's bound on a key, kept
// whatever the scope, so that a client's key is valid or not regardless of
// how the service scopes it.
const MaxKeyBytes = 256

// Scope says whose key an Idempotency-Key is. A key is a client's own
// name for one of its operations, chosen by that client: two clients may
// pick the same one, and a client may send another's (it leaks into logs,
// support tickets, a shared browser). Keys from different scopes never
// meet: a request is claimed, compared and replayed only against the
// requests of its own scope, as Stripe looks a key up only within the
// calling account and as the draft's section 5 asks.
//
// Build one with ScopeBy or, knowingly, Unscoped. The zero Scope is
// neither, and Middleware refuses it.
type Scope struct {
	of       func(r *http.Request) string
	unscoped bool
}

// ScopeBy scopes keys by what of returns for the request: the
// authenticated caller, such as the account or client id the service's
// authentication put in the request's context. Run the middleware after
// that authentication. A request with a key whose scope is empty (no
// caller) is refused with 401, reason UNAUTHENTICATED, and nothing is
// claimed: it is never served unscoped. That 401 carries no
// WWW-Authenticate, whose challenge only the service's authentication can
// name: put it in front, so that an unauthenticated caller gets its 401
// first. of runs for every keyed request with an unsafe method, before the
// body is read.
func ScopeBy(of func(r *http.Request) string) Scope { return Scope{of: of} }

// Unscoped shares one key space among every caller of the API: whoever
// sends a key gets the response recorded for it, whoever recorded it. Bob
// sending alice's key and body gets alice's response, and her request
// never runs for him; another body tells him that the key was used. Choose
// it only when a single trusted caller reaches the API (one internal
// service), or when the scope is already in the consumer (WithConsumer per
// caller). The registry key is then the Idempotency-Key as sent, as
// before scopes were required.
func Unscoped() Scope { return Scope{unscoped: true} }

// checkKeyLength refuses the keys the registry would: with a scope the
// registry sees only RegistryKey's hash, so the middleware checks them.
func checkKeyLength(key string) error {
	switch {
	case key == "":
		return errors.New("the key is empty")
	case len(key) > MaxKeyBytes:
		return errors.New("the key is longer than 256 bytes")
	}
	return nil
}

func (s Scope) valid() bool { return s.unscoped || s.of != nil }

// RegistryKey is the registry key of the Idempotency-Key key sent by a
// caller in scope (ScopeBy's value): the hex SHA-256 of scope and key,
// each length-prefixed, so that no two (scope, key) pairs share a registry
// key (scope "alice:x" with key "K" and scope "alice" with key "x:K" are two
// keys) and every pair fits the registry's 256 bytes, whatever the scope's
// length. An operator looks a caller's key up with it:
// idemreg admin inspect --consumer http --kind operation --key $(RegistryKey(...)).
func RegistryKey(scope, key string) string {
	return hex.EncodeToString(lengthPrefixedSHA256([]byte(scope), []byte(key)))
}
