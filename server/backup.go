package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"path"
	"reflect"
	"slices"
	"sync"
	"time"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/storage"
)

// Backup bounds: MaxBackups copies at once (each holds the data
// directory's sstables as they were, so disk space a compaction freed is
// not given back until it ends), BackupIdle without a ReadBackup before a
// copy is removed, DefaultBackupRead the bytes of a ReadBackup that asks
// for none, MaxBackupRead the most it may ask for (under a client's
// default 4 MiB message limit).
const (
	MaxBackups        = 2
	BackupIdle        = 5 * time.Minute
	DefaultBackupRead = 1 << 20
	MaxBackupRead     = 4<<20 - 64<<10
)

// backupAdmin is the AdminService with the backup RPCs, on the backend
// itself: a backup copies the store's files, which no decorator of the
// store chain has a part in.
type backupAdmin struct {
	*AdminService
	backups *backups
}

// withBackups adds the backups of backend to a.
func withBackups(a *AdminService, backend storage.Store) *backupAdmin {
	b := &backups{open: map[string]*openBackup{}, kind: storeKind(backend)}
	b.store, _ = backend.(storage.Backuper)
	return &backupAdmin{AdminService: a, backups: b}
}

// storeKind names the backend in BACKUP_UNSUPPORTED: its package
// ("postgres").
func storeKind(s storage.Store) string {
	t := reflect.TypeOf(s)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return ""
	}
	return path.Base(t.PkgPath())
}

type backups struct {
	store storage.Backuper // nil: the store has other tools
	kind  string
	mu    sync.Mutex
	open  map[string]*openBackup
}

type openBackup struct {
	copy  storage.BackupCopy
	timer *time.Timer // removes the copy after BackupIdle unread
}

// end removes the backup id, reporting whether it was open.
func (b *backups) end(id string) (storage.BackupCopy, bool) {
	b.mu.Lock()
	ob, ok := b.open[id]
	delete(b.open, id)
	b.mu.Unlock()
	if !ok {
		return nil, false
	}
	ob.timer.Stop()
	return ob.copy, true
}

// get returns the open backup id and restarts its idle timer.
func (b *backups) get(id string) (storage.BackupCopy, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ob, ok := b.open[id]
	if !ok {
		return nil, false
	}
	ob.timer.Reset(BackupIdle)
	return ob.copy, true
}

// mayBackUp refuses an identity that may not administer every consumer: a
// backup holds every consumer's records and results.
func (a *backupAdmin) mayBackUp(ctx context.Context) error {
	id, ok := IdentityFrom(ctx)
	if !ok {
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
	if all, _ := id.MayAdministerUnder(""); !all {
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED,
			"identity "+quote(id.Name)+" may not back up the store: that takes an admin grant on every consumer (\"*\")",
			map[string]string{"identity": id.Name})
	}
	return nil
}

var errNoSuchBackup = reason.Status(idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND,
	"no such backup in progress: it ended, or went unread for longer than the server keeps one", nil)

// BeginBackup implements AdminServiceServer.
func (a *backupAdmin) BeginBackup(ctx context.Context, _ *idemregv1.BeginBackupRequest) (*idemregv1.BeginBackupResponse, error) {
	if err := a.mayBackUp(ctx); err != nil {
		return nil, err
	}
	b := a.backups
	if b.store == nil {
		err := reason.Status(idemregv1.ErrorReason_ERROR_REASON_BACKUP_UNSUPPORTED,
			"this store is backed up with its own tools: for PostgreSQL, pg_dump or point-in-time recovery (docs/operations/runbooks.md, \"Back up and restore\")",
			map[string]string{"store": b.kind})
		a.audit(ctx, "backup", nil, "", err)
		return nil, err
	}
	b.mu.Lock()
	busy := len(b.open) >= MaxBackups
	b.mu.Unlock()
	if busy {
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_CALLS,
			"as many backups are in progress as the server allows; end one (EndBackup) or wait for it to go idle", nil)
	}
	c, err := b.store.BeginBackup(ctx)
	if err != nil {
		a.audit(ctx, "backup", nil, "", err)
		return nil, a.toStatus(ctx, "BeginBackup", storage.Key{}, err)
	}
	raw := make([]byte, 16)
	_, _ = rand.Read(raw) // never fails (crypto/rand)
	id := hex.EncodeToString(raw)
	ob := &openBackup{copy: c}
	b.mu.Lock()
	if len(b.open) >= MaxBackups {
		b.mu.Unlock()
		_ = c.Close()
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_CALLS,
			"as many backups are in progress as the server allows; end one (EndBackup) or wait for it to go idle", nil)
	}
	ob.timer = time.AfterFunc(BackupIdle, func() {
		if c, ok := b.end(id); ok {
			if err := c.Close(); err != nil {
				a.logger.Warn("removing an idle backup's copy failed", "backup_id", id, "error", err)
			}
			a.logger.Warn("backup removed after going unread", "backup_id", id, "idle", BackupIdle)
		}
	})
	b.open[id] = ob
	b.mu.Unlock()
	m := c.Manifest()
	a.audit(ctx, "backup", nil, "", nil, slog.String("backup_id", id), slog.Int64("records", m.Records), slog.Int64("bytes", m.Bytes))
	return &idemregv1.BeginBackupResponse{BackupId: id, Manifest: toManifest(m)}, nil
}

// ReadBackup implements AdminServiceServer.
func (a *backupAdmin) ReadBackup(ctx context.Context, req *idemregv1.ReadBackupRequest) (*idemregv1.ReadBackupResponse, error) {
	if err := a.mayBackUp(ctx); err != nil {
		return nil, err
	}
	var v violations
	if req.GetOffset() < 0 {
		v.add("offset", "must not be negative")
	}
	size := int(req.GetMaxBytes())
	switch {
	case size == 0:
		size = DefaultBackupRead
	case size < 0 || size > MaxBackupRead:
		v.add("max_bytes", "must be 1-%d, or 0 for %d", MaxBackupRead, DefaultBackupRead)
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	c, ok := a.backups.get(req.GetBackupId())
	if !ok {
		return nil, errNoSuchBackup
	}
	files := c.Manifest().Files
	i := slices.IndexFunc(files, func(f storage.BackupFile) bool { return f.Name == req.GetName() })
	if i < 0 {
		v.add("name", "the backup has no file %q", reason.Echo(req.GetName()))
		return nil, v.err()
	}
	size = int(min(int64(size), max(files[i].Size-req.GetOffset(), 0)))
	buf := make([]byte, size)
	n, err := c.ReadAt(req.GetName(), buf, req.GetOffset())
	eof := errors.Is(err, io.EOF) || req.GetOffset()+int64(n) >= files[i].Size
	if err != nil && !errors.Is(err, io.EOF) {
		if _, open := a.backups.get(req.GetBackupId()); !open {
			return nil, errNoSuchBackup
		}
		a.logger.WarnContext(ctx, "reading a backup failed", "backup_id", req.GetBackupId(), "error", err)
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "reading the backup's copy failed", nil)
	}
	return &idemregv1.ReadBackupResponse{Data: buf[:n], Eof: eof}, nil
}

// EndBackup implements AdminServiceServer.
func (a *backupAdmin) EndBackup(ctx context.Context, req *idemregv1.EndBackupRequest) (*idemregv1.EndBackupResponse, error) {
	if err := a.mayBackUp(ctx); err != nil {
		return nil, err
	}
	c, ok := a.backups.end(req.GetBackupId())
	if !ok {
		return nil, errNoSuchBackup
	}
	err := c.Close()
	a.audit(ctx, "backup_end", nil, "", nil, slog.String("backup_id", req.GetBackupId()))
	if err != nil {
		a.logger.WarnContext(ctx, "removing a backup's copy failed", "backup_id", req.GetBackupId(), "error", err)
	}
	return &idemregv1.EndBackupResponse{}, nil
}

func toManifest(m storage.BackupManifest) *idemregv1.BackupManifest {
	out := &idemregv1.BackupManifest{Format: int32(m.Format), LayoutVersion: int32(m.Layout), CreatedAt: timestamp(m.CreatedAt),
		Records: m.Records, CompletedRecords: m.Completed, Bytes: m.Bytes, NewestCompletedAt: timestamp(m.NewestCompletedAt),
		NewestCompletedToken: m.NewestCompletedToken, TokenHighWater: m.TokenHighWater}
	for _, f := range m.Files {
		out.Files = append(out.Files, &idemregv1.BackupFile{Name: f.Name, Size: f.Size, Sha256: f.SHA256})
	}
	return out
}
