package rotatecmd

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/cmdline"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// rotate runs rotate-claim-key with args, as the command line gives them.
func rotate(t *testing.T, args []string, stdout, stderr io.Writer) error {
	t.Helper()
	fs := flag.NewFlagSet("rotate-claim-key", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	exec := Command(fs)
	require.NoError(t, cmdline.Parse(fs, args))
	return exec(t.Context(), stdout, stderr)
}

// TestRotateClaimKey: rotate-claim-key adds generation 2 on the database
// and on a data directory, prints generations and times and never a key.
func TestRotateClaimKey(t *testing.T) {
	db := pgtest.NewDatabase(t)
	s, err := postgres.Open(t.Context(), db)
	require.NoError(t, err)
	defer s.Close()
	before, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)

	var out, errOut bytes.Buffer
	require.NoError(t, rotate(t, []string{"--database-url", db, "--grace", "90m"}, &out, &errOut))
	require.Contains(t, out.String(), "claim key generation 2 added")
	require.Contains(t, out.String(), "generation 1 accepted until")
	after, err := s.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	require.Len(t, after.Keys, 2)
	require.Equal(t, before.Keys[0].Key, after.Keys[1].Key)
	require.Equal(t, after.Keys[0].ActiveFrom.Add(90*60e9), after.Keys[1].AcceptUntil)
	for _, k := range after.Keys {
		require.NotContains(t, strings.ToLower(out.String()+errOut.String()), strings.ToLower(string(k.Key)))
	}

	dir := t.TempDir()
	p, err := pebble.Open(dir)
	require.NoError(t, err)
	_, err = p.ClaimKeyRing(t.Context())
	require.NoError(t, err)
	err = rotate(t, []string{"--data-dir", dir}, &out, &errOut)
	require.ErrorIs(t, err, pebble.ErrLocked, "a running serve holds the directory")
	require.NoError(t, p.Close())
	out.Reset()
	require.NoError(t, rotate(t, []string{"--data-dir", dir}, &out, &errOut))
	require.Contains(t, out.String(), "claim key generation 2 added")

	require.ErrorContains(t, rotate(t, []string{"--data-dir", t.TempDir() + "/missing"}, &out, &errOut), "no embedded store in --data-dir")
}

// TestRotateClaimKeyRefusesShortWindows: an activation sooner than the
// replicas' claim key refresh, or a grace shorter than --max-lease, would
// break claims in use (a replica refusing secrets of a key it has not
// read; a held claim's Complete refused once its key is retired), so
// rotate-claim-key refuses them, naming the flag and the floor, and adds
// no generation; --allow-short-rotation takes them, and the defaults
// pass.
func TestRotateClaimKeyRefusesShortWindows(t *testing.T) {
	db := pgtest.NewDatabase(t)
	s, err := postgres.Open(t.Context(), db)
	require.NoError(t, err)
	defer s.Close()
	generations := func() int {
		ring, err := s.ClaimKeyRing(t.Context())
		require.NoError(t, err)
		return len(ring.Keys)
	}
	require.Equal(t, 1, generations())

	longLease := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(longLease, []byte("consumers:\n  - {prefix: batch., lease: {max: 3h}}\n"), 0o600))
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"grace below a consumer's lease.max", []string{"--config", longLease}, []string{"--grace 2h0m0s is shorter than the longest lease.max of --config (3h0m0s)"}},
		{"activation and grace of a second", []string{"--activate-after", "1s", "--grace", "1s"},
			[]string{"--activate-after 1s is shorter than serve's claim key refresh (30s)", "--grace 1s is shorter than --max-lease (1h0m0s)", "--allow-short-rotation"}},
		{"grace below the max lease", []string{"--grace", "59m"}, []string{"--grace 59m0s is shorter than --max-lease (1h0m0s)"}},
		{"grace below a longer max lease", []string{"--max-lease", "3h"}, []string{"--grace 2h0m0s is shorter than --max-lease (3h0m0s)"}},
		{"activation below the refresh", []string{"--activate-after", "29s"}, []string{"--activate-after 29s is shorter than serve's claim key refresh (30s)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := rotate(t, append([]string{"--database-url", db}, tc.args...), &out, &errOut)
			require.Error(t, err)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.Equal(t, 1, generations(), "a refused rotation adds no generation")
		})
	}

	var out, errOut bytes.Buffer
	require.NoError(t, rotate(t, []string{"--database-url", db, "--activate-after", "1s", "--grace", "1s", "--allow-short-rotation"}, &out, &errOut))
	require.Equal(t, 2, generations())
	require.NoError(t, rotate(t, []string{"--database-url", db}, &out, &errOut), "the defaults pass")
	require.Equal(t, 3, generations())
	require.NoError(t, rotate(t, []string{"--database-url", db, "--config", longLease, "--grace", "3h"}, &out, &errOut))
	require.Equal(t, 4, generations())
}
