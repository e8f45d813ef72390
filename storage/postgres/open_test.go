package postgres_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

func openStore(t *testing.T, databaseURL string, opts ...postgres.Option) *postgres.Store {
	t.Helper()
	s, err := postgres.Open(t.Context(), databaseURL, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

func isCockroach(t *testing.T, databaseURL string) bool {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var version string
	require.NoError(t, conn.QueryRow(t.Context(), `SELECT version()`).Scan(&version))
	return strings.Contains(version, "CockroachDB")
}

// closedPortURL is a database URL nothing listens at.
func closedPortURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return "postgres://idemreg:secret@" + addr + "/idemreg?sslmode=disable"
}

func TestUnreachableDatabase(t *testing.T) {
	s := openStore(t, closedPortURL(t))
	// Far more than a refused connection takes; reaching it would mean the
	// store waited instead of failing.
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	k := storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}
	calls := []struct {
		name string
		call func() error
	}{
		{"Ping", func() error { return s.Ping(ctx) }},
		{"Claim", func() error {
			_, err := s.Claim(ctx, storage.ClaimParams{Key: k, Lease: time.Second, Retention: time.Hour})
			return err
		}},
		{"Complete", func() error {
			_, err := s.Complete(ctx, storage.CompleteParams{Key: k, Token: 1, Result: []byte("r")})
			return err
		}},
		{"Lookup", func() error { _, err := s.Lookup(ctx, k); return err }},
		{"SweepExpired", func() error { _, err := s.SweepExpired(ctx, 10); return err }},
	}
	for _, tc := range calls {
		err := tc.call()
		require.ErrorIs(t, err, storage.ErrUnavailable, tc.name)
		require.NotErrorIs(t, err, context.DeadlineExceeded, tc.name)
		require.NotContains(t, err.Error(), "secret", "%s: the password stays out of errors", tc.name)
		require.NotContains(t, err.Error(), "idemreg_records", "%s: SQL stays out of errors", tc.name)
	}
}

func TestContextErrors(t *testing.T) {
	databaseURL := pgtest.NewDatabase(t)
	s := openStore(t, databaseURL)
	k := storage.Key{Consumer: "ctx", Kind: storage.KindOperation, Key: "k"}
	p := storage.ClaimParams{Key: k, Lease: time.Minute, Retention: time.Hour, Holder: "a"}

	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := s.Claim(cancelled, p)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, storage.ErrUnavailable)

	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)

	// Another session holds the row, so Complete waits until its deadline.
	conn, err := pgx.Connect(t.Context(), databaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	defer tx.Rollback(context.Background()) //nolint:errcheck // the lock's only purpose
	_, err = tx.Exec(t.Context(), `SELECT 1 FROM idemreg_records WHERE consumer = $1 AND key = $2 FOR UPDATE`, k.Consumer, k.Key)
	require.NoError(t, err)

	short, cancelShort := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancelShort()
	_, err = s.Complete(short, storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, storage.ErrUnavailable)

	require.NoError(t, tx.Rollback(t.Context()))
	_, err = s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: res.Record.Token, Result: []byte("r")})
	require.NoError(t, err, "the store recovers once the row is free")
}

func TestOpenRejectsBadURL(t *testing.T) {
	_, err := postgres.Open(t.Context(), "postgres://idemreg:secret@127.0.0.1:notaport/idemreg")
	require.Error(t, err)
	require.NotContains(t, err.Error(), "secret", "the password stays out of errors")
}
