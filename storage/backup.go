package storage

import (
	"context"
	"time"
)

// Backuper is implemented by stores that copy themselves as files while
// they serve (the embedded store). A store with a database server of its
// own (PostgreSQL) leaves it to that server's tools.
type Backuper interface {
	// BeginBackup takes a consistent copy of the store as it is now and
	// describes it. The copy stays until its Close, which the caller
	// must call. Errors: ErrUnavailable.
	BeginBackup(ctx context.Context) (BackupCopy, error)
}

// BackupCopy is a consistent copy of a store taken by BeginBackup.
type BackupCopy interface {
	// Manifest describes the copy: every file in it with its size and
	// SHA-256, and what it holds.
	Manifest() BackupManifest
	// ReadAt reads the file name of the manifest from offset off, as
	// io.ReaderAt does (io.EOF at its end).
	ReadAt(name string, p []byte, off int64) (int, error)
	// Close removes the copy.
	Close() error
}

// BackupFormat is the version of BackupManifest and of the layout of a
// backup (its files, MANIFEST.json, BACKUP-COMPLETE) that this build
// writes and restores.
const BackupFormat = 1

// BackupManifest describes a backup. It is written as MANIFEST.json beside
// the backup's files.
type BackupManifest struct {
	// Format is BackupFormat of the build that wrote it.
	Format int `json:"format"`
	// Layout is the store's own layout version.
	Layout int `json:"layout_version"`
	// CreatedAt is the store's clock when the copy was taken: everything
	// acknowledged before it is in the copy.
	CreatedAt time.Time `json:"created_at"`
	// Records counts the records in the copy, Completed those of them
	// completed.
	Records   int64 `json:"records"`
	Completed int64 `json:"completed_records"`
	// Bytes is the size of the files together.
	Bytes int64 `json:"bytes"`
	// NewestCompletedAt and NewestCompletedToken are the newest completion
	// in the copy (zero when it has none): the newest acknowledgement a
	// restore brings back.
	NewestCompletedAt    time.Time `json:"newest_completed_at"`
	NewestCompletedToken int64     `json:"newest_completed_token"`
	// TokenHighWater is the greatest token the copy knows of: of its
	// records, and of its token floors. A restore never issues a token at
	// or below it.
	TokenHighWater int64 `json:"token_high_water"`
	// Files are the copy's files, paths relative to the backup's root with
	// forward slashes, in the order they are sent.
	Files []BackupFile `json:"files"`
}

// BackupFile is one file of a backup.
type BackupFile struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}
