package pgtest

import (
	"context"
	"net/url"
	"os/user"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemreg/idemreg/internal/tmpfs"
	"github.com/idemreg/idemreg/storage/postgres"
)

// NewDatabaseOnTmpfsAt creates, on the server at serverURL, a migrated
// database whose tables live in a tablespace on a tmpfs of size bytes
// (tmpfs.Mount: root only, a loud skip elsewhere), so that a test can
// fill the database's disk and grow it back. The server must run on this
// machine as the user postgres, which gets the tmpfs; it skips otherwise.
// The database and the tablespace are dropped when the test ends, before
// the tmpfs is unmounted.
//
// Use a server the test owns (tests/pgcluster): while the tablespace is
// full the server's checkpoints fail, and so does every DROP DATABASE on
// it, other tests' included.
func NewDatabaseOnTmpfsAt(t *testing.T, serverURL string, size int64) (string, *tmpfs.FS) {
	t.Helper()
	u, err := url.Parse(serverURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
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

	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		t.Fatalf("pgtest: connect: %v", err)
	}
	defer conn.Close(context.Background())
	name := "idemreg_full_" + randomSuffix(t)
	if _, err := conn.Exec(ctx, `CREATE TABLESPACE `+name+` LOCATION '`+fs.Dir+`'`); err != nil {
		t.Fatalf("pgtest: create tablespace on %s: %v", fs.Dir, err)
	}
	t.Cleanup(func() { drop(t, serverURL, `DROP TABLESPACE IF EXISTS `+name) })
	if _, err := conn.Exec(ctx, `CREATE DATABASE `+name+` TABLESPACE `+name); err != nil {
		t.Fatalf("pgtest: create database: %v", err)
	}
	t.Cleanup(func() { drop(t, serverURL, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`) })
	db := *u
	db.Path = "/" + name
	if err := postgres.Migrate(ctx, db.String()); err != nil {
		t.Fatalf("pgtest: migrate: %v", err)
	}
	return db.String(), fs
}

func drop(t *testing.T, serverURL, stmt string) {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		t.Errorf("pgtest: %s: %v", stmt, err)
		return
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, stmt); err != nil {
		t.Errorf("pgtest: %s: %v", stmt, err)
	}
}
