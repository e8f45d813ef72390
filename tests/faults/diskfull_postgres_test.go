package faults

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/tests/pgcluster"
)

func incompressible(name string, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.NewChaCha8([32]byte([]byte(fmt.Sprintf("%-32.32s", name)))).Read(b)
	return b
}

// TestDiskFullOnTablespace fills a database whose tablespace is a 48 MiB
// tmpfs, on a PostgreSQL cluster the test owns, with 256 KiB results: PostgreSQL's 53100 (disk_full) is an
// *storage.ExhaustedError naming the disk, not ErrUnavailable; reads go
// on while it is full; once the file system grows, writes go on, held
// keys complete, and every acknowledged result is there.
func TestDiskFullOnTablespace(t *testing.T) {
	cluster := pgcluster.Start(t)
	dbURL, fs := pgtest.NewDatabaseOnTmpfsAt(t, cluster.URL(cluster.Addr(), "postgres"), 48<<20)
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
