// Package backupcmd is idemreg backup, which copies a running embedded
// store through AdminService's backup calls into a directory or a tar
// stream, and idemreg restore, which installs such a copy as a data
// directory, refusing one that is not complete (docs/operations/runbooks.md,
// "Back up and restore the embedded store").
//
// A backup is its store's files, MANIFEST.json (storage.BackupManifest:
// each file's size and SHA-256, what the copy holds) and BACKUP-COMPLETE,
// written last: "sha256 " and the hex SHA-256 of MANIFEST.json. In a
// directory the marker is fsynced under a temporary name and renamed, after
// every file and the manifest are fsynced; in a tar stream the manifest
// comes first, the files in its order, and the marker last. Whatever lacks
// the marker, or does not match it, is not a backup.
package backupcmd

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// The names of a backup's own files beside the store's.
const (
	ManifestName = "MANIFEST.json"
	MarkerName   = "BACKUP-COMPLETE"
)

// maxManifestBytes bounds the manifest a restore reads.
const maxManifestBytes = 16 << 20

// conn is how backup reaches the server: admin's connection flags.
type conn struct {
	addr, token, ca, cert, key, serverName string
	timeout                                time.Duration
}

func (c *conn) bind(fs *flag.FlagSet) {
	fs.StringVar(&c.addr, "addr", "127.0.0.1:7350", "the server's gRPC address")
	fs.StringVar(&c.token, "token", "", "bearer token of an identity with an admin grant on every consumer (\"*\")")
	fs.StringVar(&c.ca, "tls-ca", "", "PEM file of the CA that signed the server's certificate; TLS when set")
	fs.StringVar(&c.cert, "tls-cert", "", "PEM client certificate, for an identity of its subject (with --tls-key)")
	fs.StringVar(&c.key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&c.serverName, "server-name", "", "name to verify the server's certificate against (default: --addr's host)")
	policy.DurationVar(fs, &c.timeout, "timeout", time.Minute, "give up on one call to the server after this long (the backup as a whole takes as long as it takes)")
}

// Dial connects to addr as admin's commands do: TLS with tlsCA, or
// plaintext to a loopback address only.
func (c *conn) dial() (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if c.ca != "" {
		pem, err := os.ReadFile(c.ca)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-ca %s holds no PEM certificate", c.ca)
		}
		cfg := &tls.Config{RootCAs: pool, ServerName: c.serverName, MinVersion: tls.VersionTLS12}
		if c.cert != "" || c.key != "" {
			pair, err := tls.LoadX509KeyPair(c.cert, c.key)
			if err != nil {
				return nil, fmt.Errorf("client certificate: %w", err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		}
		creds = credentials.NewTLS(cfg)
	} else if !access.Loopback(c.addr) {
		return nil, fmt.Errorf("--addr %s is not loopback: give --tls-ca, so that the token and the records do not travel in plaintext", c.addr)
	}
	return grpc.NewClient(c.addr, grpc.WithTransportCredentials(creds))
}

// Backup binds the flags of idemreg backup (a command.Func): --to DIR or
// --to - (a tar on stdout), and admin's connection flags. The token is
// read from $IDEMREG_TOKEN when --token is not given.
func Backup(fs *flag.FlagSet) command.Run {
	var c conn
	var to string
	c.bind(fs)
	fs.StringVar(&to, "to", "", "where to write the backup: a directory that does not exist or is empty, or - for a tar stream on stdout")
	return func(ctx context.Context, stdout, stderr io.Writer) error {
		if to == "" {
			return errors.New("--to is required: a directory, or - for a tar stream on stdout")
		}
		if c.token == "" {
			c.token = os.Getenv("IDEMREG_TOKEN")
		}
		cc, err := c.dial()
		if err != nil {
			return err
		}
		defer func() { _ = cc.Close() }()
		report := stdout
		if to == "-" {
			report = stderr // stdout is the backup
		}
		api := idemregv1.NewAdminServiceClient(cc)
		m, err := Run(ctx, api, c.call, to, stdout)
		if err != nil {
			return command.Exit(1, err)
		}
		PrintManifest(report, m, to)
		return nil
	}
}

// call is the context of one call to the server.
func (c *conn) call(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	return ctx, cancel
}

// PrintManifest says what a backup holds.
func PrintManifest(w io.Writer, m storage.BackupManifest, where string) {
	if where == "-" {
		where = "stdout (tar)"
	}
	fmt.Fprintf(w, "backed up %d records (%d completed), %d bytes in %d files, to %s\n", m.Records, m.Completed, m.Bytes, len(m.Files), where)
	fmt.Fprintf(w, "taken at %s (store clock): every call acknowledged before it is in the backup\n", m.CreatedAt.Format(time.RFC3339Nano))
	if m.NewestCompletedAt.IsZero() {
		fmt.Fprintln(w, "newest acknowledgement: no completed record")
	} else {
		fmt.Fprintf(w, "newest acknowledgement: a completion at %s, token %d\n", m.NewestCompletedAt.Format(time.RFC3339Nano), m.NewestCompletedToken)
	}
	fmt.Fprintf(w, "token high-water mark: %d\n", m.TokenHighWater)
}

// CallContext gives the context of one call to the server (a deadline,
// credentials).
type CallContext func(ctx context.Context) (context.Context, context.CancelFunc)

// Run backs up the server api reaches into to (a directory, or "-" for a
// tar stream on stdout) and returns the backup's manifest. It ends the
// backup on the server whatever happens. Only a backup that ran to the end
// gets its marker.
func Run(ctx context.Context, api idemregv1.AdminServiceClient, call CallContext, to string, stdout io.Writer) (storage.BackupManifest, error) {
	var m storage.BackupManifest
	var sink sink
	if to == "-" {
		sink = &tarSink{tw: tar.NewWriter(stdout)}
	} else {
		d, err := newDirSink(to)
		if err != nil {
			return m, err
		}
		sink = d
	}
	cctx, cancel := call(ctx)
	begun, err := api.BeginBackup(cctx, &idemregv1.BeginBackupRequest{})
	cancel()
	if err != nil {
		return m, fmt.Errorf("begin backup: %w", err)
	}
	id := begun.GetBackupId()
	defer func() {
		// A fresh context: the copy is removed even when ctx ended.
		cctx, cancel := call(context.WithoutCancel(ctx))
		defer cancel()
		_, _ = api.EndBackup(cctx, &idemregv1.EndBackupRequest{BackupId: id})
	}()
	m = fromProto(begun.GetManifest())
	if err := Check(m); err != nil {
		return m, fmt.Errorf("the server's manifest: %w", err)
	}
	manifest, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return m, err
	}
	manifest = append(manifest, '\n')
	if err := sink.begin(manifest); err != nil {
		return m, err
	}
	for _, f := range m.Files {
		w, err := sink.file(f)
		if err != nil {
			return m, err
		}
		h := sha256.New()
		var off int64
		for {
			cctx, cancel := call(ctx)
			got, err := api.ReadBackup(cctx, &idemregv1.ReadBackupRequest{BackupId: id, Name: f.Name, Offset: off})
			cancel()
			if err != nil {
				return m, fmt.Errorf("read %s of the backup at %d: %w", f.Name, off, err)
			}
			if off+int64(len(got.GetData())) > f.Size {
				return m, fmt.Errorf("%s of the backup: the server sent more than its %d bytes", f.Name, f.Size)
			}
			if _, err := w.Write(got.GetData()); err != nil {
				return m, err
			}
			h.Write(got.GetData())
			off += int64(len(got.GetData()))
			if got.GetEof() {
				break
			}
			if len(got.GetData()) == 0 {
				return m, fmt.Errorf("%s of the backup: the server sent nothing at %d of %d bytes", f.Name, off, f.Size)
			}
		}
		if err := verify(f, off, h); err != nil {
			return m, err
		}
		if err := sink.endFile(); err != nil {
			return m, err
		}
	}
	if err := sink.complete(marker(manifest)); err != nil {
		return m, err
	}
	return m, nil
}

// marker is BACKUP-COMPLETE's content for a manifest.
func marker(manifest []byte) []byte {
	sum := sha256.Sum256(manifest)
	return []byte("sha256 " + hex.EncodeToString(sum[:]) + "\n")
}

func verify(f storage.BackupFile, size int64, h hash.Hash) error {
	if size != f.Size {
		return fmt.Errorf("%s: %d bytes, the manifest says %d", f.Name, size, f.Size)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != f.SHA256 {
		return fmt.Errorf("%s: SHA-256 %s, the manifest says %s", f.Name, got, f.SHA256)
	}
	return nil
}

// Check refuses a manifest this build cannot restore, or whose file names
// could reach outside the directory they are restored into.
func Check(m storage.BackupManifest) error {
	if m.Format != storage.BackupFormat {
		return fmt.Errorf("backup format %d, this build reads %d", m.Format, storage.BackupFormat)
	}
	if len(m.Files) == 0 {
		return errors.New("the manifest names no file")
	}
	seen := map[string]bool{}
	var total int64
	for _, f := range m.Files {
		switch {
		case f.Name == "" || f.Name == "." || f.Name == ".." || strings.ContainsAny(f.Name, "/\\\x00") ||
			f.Name == ManifestName || f.Name == MarkerName || strings.HasPrefix(f.Name, "."):
			return fmt.Errorf("the manifest names a file %q that a backup cannot hold", f.Name)
		case seen[f.Name]:
			return fmt.Errorf("the manifest names %q twice", f.Name)
		case f.Size < 0:
			return fmt.Errorf("%s: negative size", f.Name)
		}
		if b, err := hex.DecodeString(f.SHA256); err != nil || len(b) != sha256.Size {
			return fmt.Errorf("%s: %q is not a SHA-256", f.Name, f.SHA256)
		}
		seen[f.Name] = true
		total += f.Size
	}
	if total != m.Bytes {
		return fmt.Errorf("the files add up to %d bytes, the manifest says %d", total, m.Bytes)
	}
	return nil
}

func fromProto(p *idemregv1.BackupManifest) storage.BackupManifest {
	m := storage.BackupManifest{Format: int(p.GetFormat()), Layout: int(p.GetLayoutVersion()), Records: p.GetRecords(),
		Completed: p.GetCompletedRecords(), Bytes: p.GetBytes(), NewestCompletedToken: p.GetNewestCompletedToken(),
		TokenHighWater: p.GetTokenHighWater()}
	if p.GetCreatedAt() != nil {
		m.CreatedAt = p.GetCreatedAt().AsTime()
	}
	if p.GetNewestCompletedAt() != nil {
		m.NewestCompletedAt = p.GetNewestCompletedAt().AsTime()
	}
	for _, f := range p.GetFiles() {
		m.Files = append(m.Files, storage.BackupFile{Name: f.GetName(), Size: f.GetSize(), SHA256: f.GetSha256()})
	}
	return m
}

// sink is where a backup goes.
type sink interface {
	begin(manifest []byte) error
	file(f storage.BackupFile) (io.Writer, error)
	endFile() error
	complete(marker []byte) error
}

// dirSink writes a backup into a directory.
type dirSink struct {
	dir      string
	manifest []byte
	cur      *os.File
}

func newDirSink(dir string) (*dirSink, error) {
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, err
		}
	case err != nil:
		return nil, err
	case len(entries) > 0:
		return nil, fmt.Errorf("--to %s is not empty: give a new directory", dir)
	}
	return &dirSink{dir: dir}, nil
}

func (d *dirSink) begin(manifest []byte) error { d.manifest = manifest; return nil }

func (d *dirSink) file(f storage.BackupFile) (io.Writer, error) {
	out, err := os.OpenFile(filepath.Join(d.dir, f.Name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	d.cur = out
	return out, nil
}

func (d *dirSink) endFile() error {
	err := d.cur.Sync()
	if cerr := d.cur.Close(); err == nil {
		err = cerr
	}
	return err
}

// complete writes the manifest, then the marker under a temporary name,
// both fsynced, and renames the marker into place: the marker is there
// only once everything it vouches for is on disk.
func (d *dirSink) complete(marker []byte) error {
	if err := writeSynced(filepath.Join(d.dir, ManifestName), d.manifest); err != nil {
		return err
	}
	tmp := filepath.Join(d.dir, MarkerName+".tmp")
	if err := writeSynced(tmp, marker); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(d.dir, MarkerName)); err != nil {
		return err
	}
	return syncDir(d.dir)
}

func writeSynced(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	return f.Sync()
}

// tarSink writes a backup as a tar stream.
type tarSink struct{ tw *tar.Writer }

func (t *tarSink) entry(name string, size int64) error {
	return t.tw.WriteHeader(&tar.Header{Name: name, Size: size, Mode: 0o600, Typeflag: tar.TypeReg})
}

func (t *tarSink) begin(manifest []byte) error {
	if err := t.entry(ManifestName, int64(len(manifest))); err != nil {
		return err
	}
	_, err := t.tw.Write(manifest)
	return err
}

func (t *tarSink) file(f storage.BackupFile) (io.Writer, error) {
	return t.tw, t.entry(f.Name, f.Size)
}

func (t *tarSink) endFile() error { return t.tw.Flush() }

func (t *tarSink) complete(marker []byte) error {
	if err := t.entry(MarkerName, int64(len(marker))); err != nil {
		return err
	}
	if _, err := t.tw.Write(marker); err != nil {
		return err
	}
	return t.tw.Close()
}
