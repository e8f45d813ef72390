// Package access owns who may call the registry and how often: the
// identities of the config file (matched by client-certificate identity or
// by a bearer token kept as its SHA-256 hash), the consumers each identity
// may use and administer, and the per-consumer rate limits.
//
// A Set is immutable and is replaced whole on reload (Source), so a request
// sees one set, never a mix of two. A Set without identities is open: every
// caller is the Anonymous identity and may use every consumer; the binary
// allows that only on loopback or when told to explicitly.
//
// access imports no gRPC: server/ reads the peer's certificate and the
// request's metadata and asks a Set.
package access

import (
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/idemreg/idemreg/storage"
)

// Identity is a caller the config file names.
type Identity struct {
	// Name names the identity in logs and metrics.
	Name string
	// consumers are what it may use through RegistryService; admin what it
	// may inspect, list, resolve and invalidate through AdminService.
	consumers, admin Patterns
}

// MayUse reports whether id may use consumer through RegistryService.
func (id *Identity) MayUse(consumer string) bool { return id.consumers.Match(consumer) }

// MayAdminister reports whether id may inspect, list, resolve and
// invalidate the records of consumer through AdminService.
func (id *Identity) MayAdminister(consumer string) bool { return id.admin.Match(consumer) }

// AdministersAny reports whether id has an admin grant on at least one
// consumer: whether the operator console may be opened with it.
func (id *Identity) AdministersAny() bool {
	a := id.admin
	return a.all || len(a.names) > 0 || len(a.prefixes) > 0
}

// MayAdministerUnder reports whether id may administer every consumer whose
// name starts with prefix (all), and whether it may administer at least
// one such name (some). A listing by prefix filters its records through
// MayAdminister unless all holds, and is refused when some does not: it
// could only ever come back empty, after reading other teams' records.
func (id *Identity) MayAdministerUnder(prefix string) (all, some bool) {
	return id.admin.Under(prefix)
}

// Anonymous is the identity of every caller of an open Set.
var Anonymous = &Identity{Name: "anonymous", consumers: Patterns{all: true}, admin: Patterns{all: true}}

// Patterns is a list of consumer names and prefixes, written in a config
// file as "billing.payment-worker" (that consumer), "billing.*" (every
// consumer starting with "billing.") or "*" (every consumer).
type Patterns struct {
	names    map[string]bool
	prefixes []string
	all      bool
}

// Match reports whether consumer matches one of the patterns.
func (p Patterns) Match(consumer string) bool {
	if p.all || p.names[consumer] {
		return true
	}
	for _, pre := range p.prefixes {
		if strings.HasPrefix(consumer, pre) {
			return true
		}
	}
	return false
}

// Under reports whether the patterns match every consumer name that starts
// with prefix (all), and whether they match at least one (some).
func (p Patterns) Under(prefix string) (all, some bool) {
	if p.all {
		return true, true
	}
	for _, pre := range p.prefixes {
		if strings.HasPrefix(prefix, pre) {
			return true, true // the pattern is as wide as the prefix, or wider
		}
		if strings.HasPrefix(pre, prefix) {
			some = true // a narrower pattern inside the prefix
		}
	}
	for name := range p.names {
		if strings.HasPrefix(name, prefix) {
			return false, true
		}
	}
	return false, some
}

// Set is an immutable set of identities and rate limits.
type Set struct {
	identities []*Identity
	byURI      map[string]*Identity
	byDNS      map[string]*Identity
	bySubject  map[string]*Identity
	byToken    map[[sha256.Size]byte]*Identity
	limits     limitRules
	// identityLimits are the rules of rate_limits that name identities.
	identityLimits identityRules
}

// Open returns a Set without identities: every caller is Anonymous.
func Open() *Set { return &Set{} }

// Enforced reports whether the set names identities, so that callers must
// authenticate.
func (s *Set) Enforced() bool { return len(s.identities) > 0 }

// Identities returns the names of the identities, in file order.
func (s *Set) Identities() []string {
	names := make([]string, len(s.identities))
	for i, id := range s.identities {
		names[i] = id.Name
	}
	return names
}

// HasTokens reports whether any identity authenticates by bearer token.
func (s *Set) HasTokens() bool { return len(s.byToken) > 0 }

// ByCertificate returns the identity of a verified client certificate: the
// first of its URI SANs (SPIFFE IDs) that an identity lists, else the first
// of its DNS SANs, else its subject as crypto/x509 prints it
// ("CN=worker,OU=billing,O=Example").
func (s *Set) ByCertificate(cert *x509.Certificate) (*Identity, bool) {
	for _, u := range cert.URIs {
		if id, ok := s.byURI[u.String()]; ok {
			return id, true
		}
	}
	for _, d := range cert.DNSNames {
		if id, ok := s.byDNS[strings.ToLower(d)]; ok {
			return id, true
		}
	}
	id, ok := s.bySubject[cert.Subject.String()]
	return id, ok
}

// ByName returns the identity named name: the one an in-process caller
// (the operator console) acts as, having authenticated the operator itself.
func (s *Set) ByName(name string) (*Identity, bool) {
	for _, id := range s.identities {
		if id.Name == name {
			return id, true
		}
	}
	return nil, false
}

// ByToken returns the identity of a bearer token. Only hashes are kept, and
// the final comparison is constant-time; a lookup's timing can at most hint
// at a hash, from which the token cannot be learnt.
func (s *Set) ByToken(token string) (*Identity, bool) {
	h := sha256.Sum256([]byte(token))
	for stored, id := range s.byToken {
		if subtle.ConstantTimeCompare(stored[:], h[:]) == 1 {
			return id, true
		}
	}
	return nil, false
}

// HashToken returns the form of token that a config file stores:
// "sha256:" and the hex SHA-256 of the token.
func HashToken(token string) string {
	h := sha256.Sum256([]byte(token))
	return tokenHashPrefix + hex.EncodeToString(h[:])
}

const tokenHashPrefix = "sha256:"

// parsePatterns reads consumer patterns; what names each is where, for errors.
func parsePatterns(list []string, where string) (Patterns, error) {
	p := Patterns{names: map[string]bool{}}
	for i, s := range list {
		at := fmt.Sprintf("%s[%d]", where, i)
		switch {
		case s == "*":
			p.all = true
		case strings.HasSuffix(s, "*"):
			pre := strings.TrimSuffix(s, "*")
			if err := checkConsumer(pre); err != nil {
				return Patterns{}, fmt.Errorf("%s: %w", at, err)
			}
			p.prefixes = append(p.prefixes, pre)
		default:
			if s == "" {
				return Patterns{}, fmt.Errorf("%s: empty; write a consumer name, a prefix ending in \"*\", or \"*\"", at)
			}
			if err := checkConsumer(s); err != nil {
				return Patterns{}, fmt.Errorf("%s: %w", at, err)
			}
			p.names[s] = true
		}
	}
	slices.Sort(p.prefixes)
	return p, nil
}

func checkConsumer(s string) error {
	if err := storage.CheckConsumer(s); err != nil {
		return fmt.Errorf("%q: %w (a prefix ends in \"*\")", s, err)
	}
	return nil
}

// Loopback reports whether addr (host:port) is reachable only from this
// host: where the binary serves an open Set, and where a bearer token may
// travel in plaintext.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
