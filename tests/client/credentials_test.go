package client_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// billingToken is what idemreg new-token prints; the registry's config
// keeps only its hash.
const billingToken = "idemreg_0J9n4cXk2s-test-token_uQ"

// tokenRegistry serves a real registry whose one identity, billing,
// authenticates with billingToken and may use billing.*, over TLS when
// tlsCfg is set. It returns the registry's address.
func tokenRegistry(t *testing.T, tlsCfg *tls.Config) string {
	t.Helper()
	set, err := access.Parse([]byte(`
identities:
  - name: billing
    token_hashes: ["` + access.HashToken(billingToken) + `"]
    consumers: ["billing.*"]
`))
	require.NoError(t, err)
	store, err := pebble.Open(t.TempDir(), pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	addr, _ := servertest.Serve(t, store, server.Config{Access: set, TLS: tlsCfg})
	return addr
}

// selfSigned is a certificate for 127.0.0.1, its own CA: the server's TLS
// configuration and a pool for clients that trust it.
func selfSigned(t *testing.T) (*tls.Config, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "idemreg test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	leaf, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, pool
}

// registryClient connects to addr with opts, closed when the test ends.
func registryClient(t *testing.T, addr string, opts ...grpc.DialOption) *client.Client {
	t.Helper()
	conn, err := grpc.NewClient(addr, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return client.New(conn)
}

// TestBearerToken: a registry that requires credentials takes a call made
// with client.BearerToken on its connection (TLS), and refuses the same
// call without it, or with a token it does not know.
func TestBearerToken(t *testing.T) {
	serverTLS, roots := selfSigned(t)
	addr := tokenRegistry(t, serverTLS)
	transport := grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}))
	key := client.Key{Consumer: "billing.payments", Kind: client.KindMessage, Key: "msg-1"}

	c := registryClient(t, addr, transport, grpc.WithPerRPCCredentials(client.BearerToken(billingToken)))
	res, err := c.Once(t.Context(), key.Consumer, key.Key, func(context.Context, client.Attempt) ([]byte, error) {
		return []byte("applied"), nil
	})
	require.NoError(t, err, "the token authenticates the Claim and the Complete")
	require.True(t, res.Ran)
	rec, err := c.Lookup(t.Context(), key)
	require.NoError(t, err)
	require.Equal(t, client.StateCompleted, rec.State)

	for name, opts := range map[string][]grpc.DialOption{
		"without the token":  {transport},
		"with another token": {transport, grpc.WithPerRPCCredentials(client.BearerToken("idemreg_not-a-known-token"))},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := registryClient(t, addr, opts...).Lookup(t.Context(), key)
			require.ErrorIs(t, err, client.ErrUnauthenticated)
			require.Equal(t, codes.Unauthenticated, status.Code(err))
			var e *client.Error
			require.ErrorAs(t, err, &e)
			require.Equal(t, client.ReasonUnauthenticated, e.Reason, "the registry's refusal, not the transport's")
		})
	}
}

// TestInsecureBearerToken: on a plaintext registry (loopback), BearerToken
// is refused by gRPC before anything is sent, and InsecureBearerToken is
// what authenticates.
func TestInsecureBearerToken(t *testing.T) {
	addr := tokenRegistry(t, nil)
	plaintext := grpc.WithTransportCredentials(insecure.NewCredentials())
	key := client.Key{Consumer: "billing.payments", Kind: client.KindOperation, Key: "op-1"}

	_, err := grpc.NewClient(addr, plaintext, grpc.WithPerRPCCredentials(client.BearerToken(billingToken)))
	require.ErrorContains(t, err, "transport level security", "BearerToken is never sent in plaintext")

	c := registryClient(t, addr, plaintext, grpc.WithPerRPCCredentials(client.InsecureBearerToken(billingToken)))
	cl, err := c.Claim(t.Context(), client.ClaimParams{Key: key})
	require.NoError(t, err)
	require.Equal(t, client.OutcomeAcquired, cl.Outcome)

	_, err = registryClient(t, addr, plaintext).Lookup(t.Context(), key)
	require.ErrorIs(t, err, client.ErrUnauthenticated, "the same call without the token")
}
