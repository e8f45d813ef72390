package server_test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

const backupAccess = `
identities:
  - name: ops
    token_hashes: ["` + "%s" + `"]
    consumers: ["*"]
    admin: ["*"]
  - name: billing
    token_hashes: ["` + "%s" + `"]
    consumers: ["billing.*"]
    admin: ["billing.*"]
`

// backupReason is the ErrorInfo reason of err.
func backupReason(t *testing.T, err error) string {
	t.Helper()
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// TestBackupRPCs: the three backup calls on a disk store, each file read
// whole matching its SHA-256, their refusals (an identity without a grant
// on every consumer, bad arguments, an ended backup, more backups than
// MaxBackups), and a PostgreSQL store's answer.
func TestBackupRPCs(t *testing.T) {
	store, err := pebble.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	set := accessFile(t, fmt.Sprintf(backupAccess, access.HashToken("ops-token"), access.HashToken("billing-token")))
	_, srv := serve(t, store, server.Config{Access: set})
	in, err := srv.InProcess()
	require.NoError(t, err)
	t.Cleanup(func() { _ = in.Close() })
	ops := server.ActAs(t.Context(), "ops")
	admin := idemregv1.NewAdminServiceClient(in)
	reg := idemregv1.NewRegistryServiceClient(in)
	for _, k := range []string{"a", "b", "c"} {
		_, err := reg.Claim(ops, &idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: k})
		require.NoError(t, err)
	}

	_, err = admin.BeginBackup(server.ActAs(t.Context(), "billing"), &idemregv1.BeginBackupRequest{})
	require.Equal(t, codes.PermissionDenied, status.Code(err), "a grant on billing.* only")

	begun, err := admin.BeginBackup(ops, &idemregv1.BeginBackupRequest{})
	require.NoError(t, err)
	m := begun.GetManifest()
	require.EqualValues(t, 3, m.GetRecords())
	require.NotEmpty(t, m.GetFiles())
	id := begun.GetBackupId()

	_, err = admin.ReadBackup(server.ActAs(t.Context(), "billing"), &idemregv1.ReadBackupRequest{BackupId: id, Name: m.GetFiles()[0].GetName()})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	for _, f := range m.GetFiles() {
		h := sha256.New()
		var off int64
		for {
			got, err := admin.ReadBackup(ops, &idemregv1.ReadBackupRequest{BackupId: id, Name: f.GetName(), Offset: off, MaxBytes: 1000})
			require.NoError(t, err)
			require.LessOrEqual(t, len(got.GetData()), 1000)
			h.Write(got.GetData())
			off += int64(len(got.GetData()))
			if got.GetEof() {
				break
			}
		}
		require.Equal(t, f.GetSize(), off, f.GetName())
		require.Equal(t, f.GetSha256(), hex.EncodeToString(h.Sum(nil)), f.GetName())
	}

	for _, tc := range []struct {
		name string
		req  *idemregv1.ReadBackupRequest
		code codes.Code
	}{
		{"unknown file", &idemregv1.ReadBackupRequest{BackupId: id, Name: "../idemreg.lock"}, codes.InvalidArgument},
		{"negative offset", &idemregv1.ReadBackupRequest{BackupId: id, Name: m.GetFiles()[0].GetName(), Offset: -1}, codes.InvalidArgument},
		{"too large a read", &idemregv1.ReadBackupRequest{BackupId: id, Name: m.GetFiles()[0].GetName(), MaxBytes: server.MaxBackupRead + 1}, codes.InvalidArgument},
		{"unknown backup", &idemregv1.ReadBackupRequest{BackupId: "nope", Name: m.GetFiles()[0].GetName()}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := admin.ReadBackup(ops, tc.req)
			require.Equal(t, tc.code, status.Code(err), "%v", err)
		})
	}

	// At most MaxBackups at once.
	var ids []string
	for range server.MaxBackups - 1 {
		b, err := admin.BeginBackup(ops, &idemregv1.BeginBackupRequest{})
		require.NoError(t, err)
		ids = append(ids, b.GetBackupId())
	}
	_, err = admin.BeginBackup(ops, &idemregv1.BeginBackupRequest{})
	require.Equal(t, codes.ResourceExhausted, status.Code(err))
	require.Equal(t, "TOO_MANY_CALLS", backupReason(t, err))
	for _, id := range append(ids, id) {
		_, err := admin.EndBackup(ops, &idemregv1.EndBackupRequest{BackupId: id})
		require.NoError(t, err)
	}
	_, err = admin.ReadBackup(ops, &idemregv1.ReadBackupRequest{BackupId: id, Name: m.GetFiles()[0].GetName()})
	require.Equal(t, codes.NotFound, status.Code(err), "ended")
	_, err = admin.EndBackup(ops, &idemregv1.EndBackupRequest{BackupId: id})
	require.Equal(t, codes.NotFound, status.Code(err), "ended twice")

	t.Run("postgres", func(t *testing.T) {
		pg, err := postgres.Open(t.Context(), pgtest.NewDatabase(t))
		require.NoError(t, err)
		t.Cleanup(func() { _ = pg.Close() })
		addr, _ := serve(t, pg, server.Config{}) // open: anonymous administers every consumer
		_, err = idemregv1.NewAdminServiceClient(servertest.Dial(t, addr)).BeginBackup(t.Context(), &idemregv1.BeginBackupRequest{})
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
		require.Equal(t, "BACKUP_UNSUPPORTED", backupReason(t, err))
		require.Contains(t, status.Convert(err).Message(), "pg_dump")
	})
}
