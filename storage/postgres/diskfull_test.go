package postgres_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os/user"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/tmpfs"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// fullDatabase creates a database whose tables live in a tablespace on a
// tmpfs of size bytes (owned by the server's user, postgres, which must
// run on this machine), migrated, and returns its URL and the file
// system. The database and the tablespace are dropped when the test ends.
func fullDatabase(t *testing.T, size int64) (string, *tmpfs.FS) {
	t.Helper()
	serverURL := pgtest.ServerURL()
	u, err := url.Parse(serverURL)
	require.NoError(t, err)
	if h := u.Hostname(); h != "127.0.0.1" && h != "localhost" && h != "::1" {
		t.Skipf("SKIPPED, NOT RUN: the tablespace must be on the database server's machine, and %s is not local", h)
	}
	pg, err := user.Lookup("postgres")
	if err != nil {
		t.Skipf("SKIPPED, NOT RUN: no postgres user to own the tablespace: %v", err)
	}
	fs := tmpfs.Mount(t, size)
	uid, _ := strconv.Atoi(pg.Uid)
	gid, _ := strconv.Atoi(pg.Gid)
	fs.Chown(t, uid, gid)

	ctx := t.Context()
	conn, err := pgx.Connect(ctx, serverURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	name := fmt.Sprintf("idemreg_full_%d", rand.Uint64())
	_, err = conn.Exec(ctx, `CREATE TABLESPACE `+name+` LOCATION '`+fs.Dir+`'`)
	require.NoError(t, err)
	t.Cleanup(func() { drop(t, serverURL, `DROP TABLESPACE IF EXISTS `+name) })
	_, err = conn.Exec(ctx, `CREATE DATABASE `+name+` TABLESPACE `+name)
	require.NoError(t, err)
	t.Cleanup(func() { drop(t, serverURL, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`) })
	db := *u
	db.Path = "/" + name
	require.NoError(t, postgres.Migrate(ctx, db.String()))
	return db.String(), fs
}

func drop(t *testing.T, serverURL, stmt string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		t.Errorf("%s: %v", stmt, err)
		return
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, stmt); err != nil {
		t.Errorf("%s: %v", stmt, err)
	}
}

func incompressible(name string, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.NewChaCha8([32]byte([]byte(fmt.Sprintf("%-32.32s", name)))).Read(b)
	return b
}

// TestDiskFullOnTablespace fills a database whose tablespace is a 48 MiB
// tmpfs with 256 KiB results: PostgreSQL's 53100 (disk_full) is an
// *storage.ExhaustedError naming the disk, not ErrUnavailable; reads go
// on while it is full; once the file system grows, writes go on, held
// keys complete, and every acknowledged result is there.
func TestDiskFullOnTablespace(t *testing.T) {
	dbURL, fs := fullDatabase(t, 48<<20)
	ctx := t.Context()
	s, err := postgres.Open(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	k := func(name string) storage.Key {
		return storage.Key{Consumer: "disk.test", Kind: storage.KindOperation, Key: name}
	}
	claim := func(name string) (storage.ClaimResult, error) {
		return s.Claim(ctx, storage.ClaimParams{Key: k(name), Lease: time.Hour, Retention: time.Hour, Holder: "h"})
	}

	held := map[string]int64{}
	for i := range 4 {
		res, err := claim(fmt.Sprintf("held-%d", i))
		require.NoError(t, err)
		held[res.Record.Key.Key] = res.Record.Token
	}
	acked := map[string][]byte{}
	var full error
	for i := 0; full == nil; i++ {
		require.Less(t, i, 1000, "the database never reported its disk full on a 48 MiB tablespace")
		name := fmt.Sprintf("fill-%d", i)
		res, err := claim(name)
		if err != nil {
			full = err
			break
		}
		r := incompressible(name, 256<<10)
		if _, err := s.Complete(ctx, storage.CompleteParams{Key: k(name), Token: res.Record.Token, Result: r}); err != nil {
			full = err
			held[name] = res.Record.Token
			break
		}
		acked[name] = r
	}
	t.Logf("%d results of 256 KiB acknowledged, then %v", len(acked), full)
	require.ErrorIs(t, full, storage.ErrExhausted)
	require.NotErrorIs(t, full, storage.ErrUnavailable, "a full disk is not an outage")
	var ex *storage.ExhaustedError
	require.ErrorAs(t, full, &ex)
	require.Equal(t, storage.ResourceDisk, ex.Resource)
	require.Contains(t, ex.Error(), "53100")

	// Reads go on while it is full.
	for name, want := range acked {
		rec, err := s.Lookup(ctx, k(name))
		require.NoError(t, err)
		require.Equal(t, want, rec.Result)
		break
	}

	// The file system grows: writes go on, and the held keys complete.
	fs.Resize(t, 128<<20)
	for name, token := range held {
		r := incompressible(name, 64<<10)
		_, err := s.Complete(ctx, storage.CompleteParams{Key: k(name), Token: token, Result: r})
		require.NoError(t, err, "%s completes once there is space", name)
		acked[name] = r
	}
	res, err := claim("after-grow")
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)

	// Nothing acknowledged was lost, read through a new store.
	require.NoError(t, s.Close())
	s, err = postgres.Open(ctx, dbURL)
	require.NoError(t, err)
	for name, want := range acked {
		rec, err := s.Lookup(ctx, k(name))
		require.NoError(t, err, name)
		require.Equal(t, storage.StateCompleted, rec.State, name)
		require.Equal(t, want, rec.Result, name)
	}
}
