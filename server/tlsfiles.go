package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// TLSFiles are the PEM files of the server's TLS.
type TLSFiles struct {
	// CertFile and KeyFile are the server's certificate chain and key.
	CertFile, KeyFile string
	// ClientCAFile, when set, holds the CAs that sign client certificates:
	// every client must then present a certificate they verify (mTLS).
	ClientCAFile string
}

// tlsRecheck is how often the files are looked at for a rotation.
const tlsRecheck = 10 * time.Second

// TLSConfig returns a server TLS configuration on files. The files are
// read again when their modification time changes (looked at, at most every
// 10 s, by the next handshake), so a certificate rotated on disk — by
// cert-manager in a mounted Secret, say — is served without a restart; a
// rotation that cannot be read keeps the previous files in force and is
// logged.
func TLSConfig(files TLSFiles, logger *slog.Logger) (*tls.Config, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &tlsReloader{files: files, logger: logger}
	cfg, stamps, err := r.load()
	if err != nil {
		return nil, err
	}
	r.cur, r.stamps, r.checked = cfg, stamps, time.Now()
	return &tls.Config{
		MinVersion:         tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return r.get(), nil },
	}, nil
}

type tlsReloader struct {
	files  TLSFiles
	logger *slog.Logger

	mu      sync.Mutex
	cur     *tls.Config
	stamps  []time.Time
	checked time.Time
}

func (r *tlsReloader) paths() []string {
	p := []string{r.files.CertFile, r.files.KeyFile}
	if r.files.ClientCAFile != "" {
		p = append(p, r.files.ClientCAFile)
	}
	return p
}

func (r *tlsReloader) stat() ([]time.Time, error) {
	var out []time.Time
	for _, p := range r.paths() {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		out = append(out, fi.ModTime())
	}
	return out, nil
}

func (r *tlsReloader) load() (*tls.Config, []time.Time, error) {
	stamps, err := r.stat()
	if err != nil {
		return nil, nil, fmt.Errorf("tls: %w", err)
	}
	cert, err := tls.LoadX509KeyPair(r.files.CertFile, r.files.KeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: certificate %s and key %s: %w", r.files.CertFile, r.files.KeyFile, err)
	}
	cfg := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{"h2"}, // gRPC is HTTP/2; grpc-go requires the ALPN
	}
	if r.files.ClientCAFile != "" {
		pem, err := os.ReadFile(r.files.ClientCAFile)
		if err != nil {
			return nil, nil, fmt.Errorf("tls: client CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, errors.New("tls: client CA " + r.files.ClientCAFile + " holds no PEM certificate")
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, stamps, nil
}

func (r *tlsReloader) get() *tls.Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.checked) < tlsRecheck {
		return r.cur
	}
	r.checked = time.Now()
	stamps, err := r.stat()
	if err != nil || equalTimes(stamps, r.stamps) {
		return r.cur
	}
	cfg, stamps, err := r.load()
	if err != nil {
		r.logger.Error("tls files changed but cannot be loaded; keeping the previous ones", "error", err)
		return r.cur
	}
	r.cur, r.stamps = cfg, stamps
	r.logger.Info("tls files reloaded", "cert_file", r.files.CertFile)
	return cfg
}

func equalTimes(a, b []time.Time) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].Equal(b[i]) {
			return false
		}
	}
	return true
}
