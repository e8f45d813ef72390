package server_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pki is a throwaway certificate authority for a test: a CA, certificates
// it signs, and their PEM files in a temporary directory.
type pki struct {
	t    *testing.T
	dir  string
	ca   *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

var serial atomic.Int64

func newPKI(t *testing.T, name string) *pki {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial.Add(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	p := &pki{t: t, dir: t.TempDir(), ca: ca, key: key, pool: pool}
	p.write("ca.pem", "CERTIFICATE", der)
	return p
}

func (p *pki) write(name, kind string, der []byte) string {
	path := filepath.Join(p.dir, name)
	require.NoError(p.t, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600))
	return path
}

func (p *pki) caFile() string { return filepath.Join(p.dir, "ca.pem") }

// issued is a certificate the CA signed, with its key, as a tls.Certificate
// and as PEM files.
type issued struct {
	cert              tls.Certificate
	certFile, keyFile string
}

// issue signs a certificate. Server certificates name 127.0.0.1; client
// certificates carry the given URI SANs, DNS SANs and subject.
func (p *pki) issue(name string, server bool, uris []string, dns []string, subject pkix.Name) issued {
	p.t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(p.t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial.Add(1)),
		Subject:      subject,
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		DNSNames:     dns,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		require.NoError(p.t, err)
		tmpl.URIs = append(tmpl.URIs, parsed)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.key)
	require.NoError(p.t, err)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(p.t, err)
	leaf, err := x509.ParseCertificate(der)
	require.NoError(p.t, err)
	return issued{
		cert:     tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf},
		certFile: p.write(name+".pem", "CERTIFICATE", der),
		keyFile:  p.write(name+"-key.pem", "PRIVATE KEY", keyDER),
	}
}

// clientTLS is what a client of the test server uses: the CA to verify
// the server, and its own certificate when it has one.
func (p *pki) clientTLS(own *issued) *tls.Config {
	cfg := &tls.Config{RootCAs: p.pool, MinVersion: tls.VersionTLS12}
	if own != nil {
		cfg.Certificates = []tls.Certificate{own.cert}
	}
	return cfg
}
