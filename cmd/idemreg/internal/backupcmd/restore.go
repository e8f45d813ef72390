package backupcmd

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
)

// ErrIncomplete is returned by RunRestore for a directory or stream that
// is not a complete backup.
var ErrIncomplete = errors.New("not a complete backup")

// Restore binds the flags of idemreg restore (a command.Func): --from DIR
// or --from - (a tar stream on stdin), --data-dir, --force.
func Restore(fs *flag.FlagSet) command.Run {
	var o RestoreOptions
	fs.StringVar(&o.From, "from", "", "the backup: a directory idemreg backup wrote, or - for its tar stream on stdin")
	fs.StringVar(&o.DataDir, "data-dir", "", "the data directory to restore into: missing or empty, or any with --force; no serve may hold it")
	fs.BoolVar(&o.Force, "force", false, "replace a data directory that holds files (the tokens in it still count: none is issued again)")
	return func(ctx context.Context, stdout, stderr io.Writer) error {
		if o.From == "" || o.DataDir == "" {
			return errors.New("--from and --data-dir are required")
		}
		o.Stdin = os.Stdin
		// pebble says much as it opens the copy; only what goes wrong matters here.
		o.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		res, err := RunRestore(ctx, o)
		if err != nil {
			return command.Exit(1, err)
		}
		PrintRestore(stdout, o.DataDir, res)
		return nil
	}
}

// RestoreOptions are the arguments of RunRestore.
type RestoreOptions struct {
	// From is a backup's directory, or "-" for its tar stream on Stdin.
	From    string
	Stdin   io.Reader
	DataDir string
	Force   bool
	Logger  *slog.Logger
}

// RestoreResult is what RunRestore restored.
type RestoreResult struct {
	Manifest storage.BackupManifest
	pebble.RestoreResult
}

// PrintRestore says what a restore did.
func PrintRestore(w io.Writer, dataDir string, r RestoreResult) {
	m := r.Manifest
	fmt.Fprintf(w, "restored %d records (%d completed) into %s, from a backup taken at %s (store clock)\n",
		r.Records, m.Completed, dataDir, m.CreatedAt.Format(time.RFC3339Nano))
	if !m.NewestCompletedAt.IsZero() {
		fmt.Fprintf(w, "newest acknowledgement: a completion at %s, token %d; completions after it are lost and their keys run again\n",
			m.NewestCompletedAt.Format(time.RFC3339Nano), m.NewestCompletedToken)
	}
	if r.Replaced && r.ReplacedErr != nil {
		fmt.Fprintf(w, "the replaced data directory could not be read (%v): tokens after the restore exceed the backup's and the clock's\n", r.ReplacedErr)
	}
	fmt.Fprintf(w, "every token issued from now on exceeds %d\n", r.TokenFloor)
}

// RunRestore checks the backup o.From, copies it beside o.DataDir and
// installs it there (pebble.Restore). A backup that is not complete is
// refused with ErrIncomplete before anything in o.DataDir is touched.
func RunRestore(ctx context.Context, o RestoreOptions) (RestoreResult, error) {
	var res RestoreResult
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	dataDir, err := filepath.Abs(o.DataDir)
	if err != nil {
		return res, err
	}
	if !o.Force {
		// Early, before reading a stream that may be large; Restore
		// checks again under the directory's lock.
		if entries, err := os.ReadDir(dataDir); err == nil && len(entries) > 0 {
			return res, fmt.Errorf("%w: %s (restore with --force to replace it)", pebble.ErrNotEmpty, dataDir)
		}
	}
	if err := os.MkdirAll(filepath.Dir(dataDir), 0o750); err != nil {
		return res, err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dataDir), filepath.Base(dataDir)+".restore-")
	if err != nil {
		return res, err
	}
	defer func() { _ = os.RemoveAll(tmp) }() // gone already when installed
	var m storage.BackupManifest
	if o.From == "-" {
		m, err = copyTar(ctx, o.Stdin, tmp)
	} else {
		m, err = copyDir(ctx, o.From, tmp)
	}
	if err != nil {
		return res, err
	}
	res.Manifest = m
	res.RestoreResult, err = pebble.Restore(tmp, dataDir, m, pebble.RestoreOptions{Force: o.Force, Logger: o.Logger})
	return res, err
}

func incomplete(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrIncomplete, fmt.Sprintf(format, args...))
}

// readManifest decodes and checks a manifest against its marker.
func readManifest(manifest, mark []byte) (storage.BackupManifest, error) {
	var m storage.BackupManifest
	if !bytes.Equal(mark, marker(manifest)) {
		return m, incomplete("%s does not match %s: the backup was not finished, or was changed after", MarkerName, ManifestName)
	}
	dec := json.NewDecoder(bytes.NewReader(manifest))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return m, incomplete("%s: %v", ManifestName, err)
	}
	if err := Check(m); err != nil {
		return m, incomplete("%s: %v", ManifestName, err)
	}
	return m, nil
}

// copyDir checks the backup in dir and copies its files into tmp.
func copyDir(ctx context.Context, dir, tmp string) (storage.BackupManifest, error) {
	mark, err := os.ReadFile(filepath.Join(dir, MarkerName))
	if errors.Is(err, os.ErrNotExist) {
		return storage.BackupManifest{}, incomplete("%s has no %s: the backup did not finish", dir, MarkerName)
	}
	if err != nil {
		return storage.BackupManifest{}, err
	}
	manifest, err := readBounded(filepath.Join(dir, ManifestName))
	if err != nil {
		return storage.BackupManifest{}, incomplete("%v", err)
	}
	m, err := readManifest(manifest, mark)
	if err != nil {
		return m, err
	}
	for _, f := range m.Files {
		if err := ctx.Err(); err != nil {
			return m, err
		}
		in, err := os.Open(filepath.Join(dir, f.Name))
		if err != nil {
			return m, incomplete("%v", err)
		}
		err = copyFile(in, f, tmp)
		_ = in.Close()
		if err != nil {
			return m, err
		}
	}
	return m, nil
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, maxManifestBytes+1))
	if err == nil && len(b) > maxManifestBytes {
		err = fmt.Errorf("%s is over %d bytes", path, maxManifestBytes)
	}
	return b, err
}

// copyFile copies f from r into dir, checking its size and SHA-256, and
// fsyncs it.
func copyFile(r io.Reader, f storage.BackupFile, dir string) error {
	out, err := os.OpenFile(filepath.Join(dir, f.Name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(out, h), io.LimitReader(r, f.Size+1))
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return incomplete("%s: %v", f.Name, err)
		}
		return err
	}
	if err := verify(f, n, h); err != nil {
		return incomplete("%v", err)
	}
	return nil
}

// copyTar checks the backup stream r (manifest, files in its order,
// marker) and copies its files into tmp.
func copyTar(ctx context.Context, r io.Reader, tmp string) (storage.BackupManifest, error) {
	var m storage.BackupManifest
	tr := tar.NewReader(r)
	next := func(want string) (*tar.Header, error) {
		h, err := tr.Next()
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			return nil, incomplete("the stream ends before %s: the backup did not finish", want)
		case err != nil:
			return nil, incomplete("%v", err)
		case h.Name != want:
			return nil, incomplete("%s where %s was expected", h.Name, want)
		case h.Typeflag != tar.TypeReg:
			return nil, incomplete("%s is not a regular file", h.Name)
		}
		return h, nil
	}
	h, err := next(ManifestName)
	if err != nil {
		return m, err
	}
	if h.Size > maxManifestBytes {
		return m, incomplete("%s is over %d bytes", ManifestName, maxManifestBytes)
	}
	manifest, err := io.ReadAll(tr)
	if err != nil {
		return m, incomplete("%s: %v", ManifestName, err)
	}
	// The marker comes last; the manifest is checked for itself first,
	// and against the marker at the end.
	dec := json.NewDecoder(bytes.NewReader(manifest))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return m, incomplete("%s: %v", ManifestName, err)
	}
	if err := Check(m); err != nil {
		return m, incomplete("%s: %v", ManifestName, err)
	}
	for _, f := range m.Files {
		if err := ctx.Err(); err != nil {
			return m, err
		}
		h, err := next(f.Name)
		if err != nil {
			return m, err
		}
		if h.Size != f.Size {
			return m, incomplete("%s: %d bytes in the stream, the manifest says %d", f.Name, h.Size, f.Size)
		}
		if err := copyFile(tr, f, tmp); err != nil {
			return m, err
		}
	}
	if _, err := next(MarkerName); err != nil {
		return m, err
	}
	mark, err := io.ReadAll(io.LimitReader(tr, 1024))
	if err != nil {
		return m, incomplete("%s: %v", MarkerName, err)
	}
	if _, err := readManifest(manifest, mark); err != nil {
		return m, err
	}
	// The marker vouches for the rest; the tar's end (two zero blocks)
	// may be missing, but nothing may follow the marker.
	if _, err := tr.Next(); !errors.Is(err, io.EOF) {
		return m, incomplete("the stream goes on after %s", MarkerName)
	}
	return m, nil
}
