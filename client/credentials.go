package client

import (
	"context"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
)

// BearerToken returns per-RPC credentials that authenticate every call on a
// connection to the registry with token, the way the registry checks it:
// "authorization: Bearer <token>" (idemreg new-token makes one; the
// registry's config file keeps its hash). Use it on the registry's own
// connection, never on a downstream's:
//
//	conn, err := grpc.NewClient(addr,
//		grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig)),
//		grpc.WithPerRPCCredentials(client.BearerToken(token)))
//
// The token is a secret that lets anyone who sees it act as its identity,
// so its RequireTransportSecurity is true and gRPC sends it only over a
// connection with privacy and integrity (TLS, or a Unix socket with gRPC's
// local credentials): grpc.NewClient refuses it with plaintext transport
// credentials, and a connection whose transport does not encrypt (local
// credentials over TCP) fails, UNAVAILABLE, before a call is sent. For a
// registry on loopback, or behind a sidecar that encrypts for you, use
// InsecureBearerToken.
//
// A token that is empty or has a byte outside printable ASCII, a space or
// a trailing newline read from a file for instance, fails every call with
// ErrUnauthenticated (UNAUTHENTICATED), without being sent. The
// credentials print as "client.BearerToken(redacted)" with every fmt verb,
// never the token.
func BearerToken(token string) credentials.PerRPCCredentials {
	return newBearer(token, true)
}

// InsecureBearerToken is BearerToken for a connection that does not
// encrypt: it sends the token over any connection, plaintext included. Use
// it only where nobody but the two ends can read the traffic (a registry on
// 127.0.0.1 or a Unix socket, or a service mesh's sidecar on the same host
// that encrypts between hosts); anyone who can see the connection can take
// the token.
func InsecureBearerToken(token string) credentials.PerRPCCredentials {
	return newBearer(token, false)
}

type bearerToken struct {
	header string // "Bearer <token>"
	err    error  // why the token is refused; no call sends it
	secure bool
}

func newBearer(token string, secure bool) *bearerToken {
	b := &bearerToken{secure: secure}
	if msg := badToken(token); msg != "" {
		b.err = newStatus(codes.Unauthenticated, ReasonUnauthenticated, "client.BearerToken: "+msg+"; the token was not sent").Err()
		return b
	}
	b.header = "Bearer " + token
	return b
}

// badToken says what is wrong with token, never quoting it: what gRPC
// metadata can carry is printable ASCII, and a space would end the token
// where the registry reads it.
func badToken(token string) string {
	if token == "" {
		return "the token is empty"
	}
	for i := 0; i < len(token); i++ {
		if c := token[i]; c <= ' ' || c > '~' {
			return fmt.Sprintf("the token has a space, control or non-ASCII byte at offset %d (trim what was read from a file or variable)", i)
		}
	}
	return ""
}

// GetRequestMetadata returns the authorization header. Whether the
// connection may carry it is gRPC's check, on RequireTransportSecurity,
// made before this is called (for credentials given as a dial option and
// as a call option alike).
func (b *bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	if b.err != nil {
		return nil, b.err
	}
	return map[string]string{"authorization": b.header}, nil
}

// RequireTransportSecurity is true for BearerToken, false for
// InsecureBearerToken.
func (b *bearerToken) RequireTransportSecurity() bool { return b.secure }

// String keeps the token out of logs and error messages.
func (b *bearerToken) String() string {
	if b.secure {
		return "client.BearerToken(redacted)"
	}
	return "client.InsecureBearerToken(redacted)"
}

// Format prints String for every verb: %+v, %#v and %x too would
// otherwise print the fields, the token among them.
func (b *bearerToken) Format(f fmt.State, _ rune) { _, _ = fmt.Fprint(f, b.String()) }

var _ credentials.PerRPCCredentials = (*bearerToken)(nil)
