package backupcmd_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/backupcmd"
	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/pebble"
)

func TestMain(m *testing.M) { servetest.Main(m) }

// call gives each call of a backup a deadline; the serves here are open
// (no identities), so no credentials.
func call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, 30*time.Second)
}

// serve starts serve on dataDir and waits until it serves.
func serve(t *testing.T, dataDir string) (*servetest.Process, idemregv1.RegistryServiceClient, idemregv1.AdminServiceClient) {
	t.Helper()
	p := servetest.Start(t, servetest.Binary(t), t.TempDir(), nil, "--data-dir", dataDir)
	p.Quiet.Store(true)
	p.WaitLog(t, "serving")
	conn := servetest.Dial(t, p.Addr)
	return p, idemregv1.NewRegistryServiceClient(conn), idemregv1.NewAdminServiceClient(conn)
}

const consumer = "backup-test"

func claim(ctx context.Context, api idemregv1.RegistryServiceClient, key string, lease time.Duration) (*idemregv1.ClaimResponse, error) {
	return api.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Lease: durationpb.New(lease), Retention: durationpb.New(24 * time.Hour), Holder: "test"})
}

func complete(ctx context.Context, api idemregv1.RegistryServiceClient, key string, c *idemregv1.ClaimResponse) error {
	_, err := api.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
		Token: c.GetToken(), ClaimSecret: c.GetClaimSecret(), Result: failure(key)})
	return err
}

// failure is key's result: a failure to replay, which needs no type.
func failure(key string) *idemregv1.Result {
	return &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: int32(codes.Aborted), Message: "result of " + key}}}
}

// held is a claim someone holds: its key and the answer that acquired it.
type held struct {
	key string
	res *idemregv1.ClaimResponse
}

// TestBackupUnderLoadRestoreKeepsFencing backs up a serving embedded store
// while workers claim and complete, goes on on the timeline the backup
// loses, restores into a new directory, serves it and checks the three
// properties of issue 40: every Complete acknowledged before the backup
// began replays its result; a holder of the lost timeline is refused and
// every token issued after the restore exceeds every token issued before
// it; claim secrets issued before the backup still verify.
func TestBackupUnderLoadRestoreKeepsFencing(t *testing.T) {
	ctx := t.Context()
	parent := t.TempDir()
	p, api, admin := serve(t, filepath.Join(parent, "data"))

	// Claims held from before the backup: their holders must still be
	// able to finish after the restore.
	var before []held
	for i := range 5 {
		k := fmt.Sprintf("held-%d", i)
		res, err := claim(ctx, api, k, time.Hour)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
		before = append(before, held{k, res})
	}

	// Workers claim and complete new keys; each completion is noted with
	// the time its acknowledgement came back.
	type ack struct {
		key   string
		token int64
		at    time.Time
	}
	var (
		mu      sync.Mutex
		acks    []ack
		maxSeen atomic.Int64
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	seen := func(tok int64) {
		for {
			cur := maxSeen.Load()
			if tok <= cur || maxSeen.CompareAndSwap(cur, tok) {
				return
			}
		}
	}
	for _, h := range before {
		seen(h.res.GetToken())
	}
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := fmt.Sprintf("w%d-%d", w, i)
				res, err := claim(ctx, api, k, time.Minute)
				if err != nil {
					t.Errorf("claim %s: %v", k, err)
					return
				}
				seen(res.GetToken())
				if err := complete(ctx, api, k, res); err != nil {
					t.Errorf("complete %s: %v", k, err)
					return
				}
				mu.Lock()
				acks = append(acks, ack{k, res.GetToken(), time.Now()})
				mu.Unlock()
			}
		})
	}
	time.Sleep(500 * time.Millisecond) // some acknowledgements before the backup
	backupStart := time.Now()
	dir := filepath.Join(parent, "backup")
	var out bytes.Buffer
	m, err := backupcmd.Run(ctx, admin, call, dir, &out)
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond) // completions after the backup: the lost timeline's
	close(stop)
	wg.Wait()
	backupcmd.PrintManifest(&out, m, dir)
	t.Logf("%s", out.String())
	require.FileExists(t, filepath.Join(dir, backupcmd.MarkerName))

	mu.Lock()
	var ackedBefore, ackedAfter []ack
	for _, a := range acks {
		if a.at.Before(backupStart) {
			ackedBefore = append(ackedBefore, a)
		} else {
			ackedAfter = append(ackedAfter, a)
		}
	}
	mu.Unlock()
	require.NotEmpty(t, ackedBefore)
	require.GreaterOrEqual(t, m.Completed, int64(len(ackedBefore)))

	// The lost timeline: a holder from before the backup completes, and
	// new keys are claimed and held.
	require.NoError(t, complete(ctx, api, before[0].key, before[0].res))
	var lost []held
	for i := range 5 {
		k := fmt.Sprintf("lost-%d", i)
		res, err := claim(ctx, api, k, time.Hour)
		require.NoError(t, err)
		seen(res.GetToken())
		lost = append(lost, held{k, res})
	}
	p.Stop(t)

	restored := filepath.Join(parent, "restored")
	var logs bytes.Buffer
	res, err := backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: dir, DataDir: restored})
	require.NoError(t, err)
	backupcmd.PrintRestore(&logs, restored, res)
	t.Logf("%s", logs.String())
	require.Equal(t, m.Records, res.Records)
	require.Greater(t, res.TokenFloor, maxSeen.Load()-1)

	_, api, _ = serve(t, restored)
	// 1. Every completion acknowledged before the backup began replays.
	for _, a := range ackedBefore {
		got, err := claim(ctx, api, a.key, time.Minute)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, got.GetOutcome(), a.key)
		require.Equal(t, a.token, got.GetRecord().GetToken(), a.key)
		require.Equal(t, "result of "+a.key, got.GetRecord().GetResult().GetFailure().GetMessage(), a.key)
	}
	// 2. The lost timeline's holders are refused.
	for _, h := range lost {
		err := complete(ctx, api, h.key, h.res)
		require.Error(t, err, h.key)
		require.Contains(t, []codes.Code{codes.NotFound, codes.FailedPrecondition}, status.Code(err), h.key)
	}
	// A completion after the backup is lost: its key runs again, which
	// the attempt number tells (here the lease of the restored attempt
	// is still running, so the key is in progress, not completed).
	if len(ackedAfter) > 0 {
		a := ackedAfter[len(ackedAfter)-1]
		got, err := claim(ctx, api, a.key, time.Minute)
		require.NoError(t, err)
		require.NotEqual(t, idemregv1.Outcome_OUTCOME_COMPLETED, got.GetOutcome(), a.key)
	}
	// 3. Claim secrets from before the backup still verify: the holders
	// of before[1:] finish (before[0] completed on the lost timeline
	// only, so it is in progress again and its holder may finish too).
	for _, h := range before {
		require.NoError(t, complete(ctx, api, h.key, h.res), h.key)
	}
	// 4. Every token issued now exceeds every token issued before.
	earlier := maxSeen.Load()
	for _, k := range []string{"fresh-1", "fresh-2", lost[0].key, lost[1].key} {
		got, err := claim(ctx, api, k, time.Minute)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, got.GetOutcome(), k)
		require.Greater(t, got.GetToken(), earlier, k)
		require.Greater(t, got.GetToken(), res.TokenFloor, k)
	}
}

// TestRestoreRefusesHalfMadeBackups: a backup whose process was SIGKILLed
// midway (into a directory, and as a tar stream), a stream cut short at
// any point, and a file changed after the backup are refused, and the
// data directory given is left as it was.
func TestRestoreRefusesHalfMadeBackups(t *testing.T) {
	ctx := t.Context()
	parent := t.TempDir()
	p, api, admin := serve(t, filepath.Join(parent, "data"))
	for i := range 2000 {
		k := fmt.Sprintf("k-%d", i)
		res, err := claim(ctx, api, k, time.Minute)
		require.NoError(t, err)
		require.NoError(t, complete(ctx, api, k, res))
	}

	// A complete stream, then cut short: in its header, in its files,
	// before its marker, in the marker's 72 bytes (the tar's last 1024
	// bytes are its end, two zero blocks, and the 440 before them the
	// marker's padding: a stream cut there has every byte the marker
	// vouches for, and restores).
	var stream bytes.Buffer
	_, err := backupcmd.Run(ctx, admin, call, "-", &stream)
	require.NoError(t, err)
	full := stream.Bytes()
	target := filepath.Join(parent, "target")
	for _, n := range []int{0, 100, 512, 1024, len(full) / 3, len(full) / 2, len(full) - 2048, len(full) - 1024 - 500, len(full) - 1024 - 512 + 40} {
		_, err := backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: "-", Stdin: bytes.NewReader(full[:n]), DataDir: target})
		require.ErrorIs(t, err, backupcmd.ErrIncomplete, "cut at %d of %d", n, len(full))
		require.NoDirExists(t, target)
	}
	// A changed byte in a file: its SHA-256 no longer matches.
	bad := bytes.Clone(full)
	bad[len(full)/2] ^= 0xff
	_, err = backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: "-", Stdin: bytes.NewReader(bad), DataDir: target})
	require.ErrorIs(t, err, backupcmd.ErrIncomplete)
	require.NoDirExists(t, target)
	// The whole stream restores.
	res, err := backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: "-", Stdin: bytes.NewReader(full), DataDir: target})
	require.NoError(t, err)
	require.EqualValues(t, 2000, res.Records)

	// A data directory with a store in it: a refused restore, even with
	// Force, leaves it as it was.
	before := treeDigest(t, target)

	// SIGKILL the backup process midway, into a directory and on stdout.
	bin := buildBackupMain(t)
	for _, to := range []string{"dir", "-"} {
		t.Run("killed "+to, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "backup")
			stdout := filepath.Join(t.TempDir(), "stream.tar")
			f, err := os.Create(stdout)
			require.NoError(t, err)
			defer f.Close()
			arg := out
			if to == "-" {
				arg = "-"
			}
			cmd := exec.Command(bin, "--addr", p.Addr, "--to", arg)
			cmd.Stdout = f
			cmd.Env = append(os.Environ(), "BACKUP_TEST_READ_DELAY=50ms")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			require.NoError(t, cmd.Start())
			// Kill once a part is written, well before the end. stderr is
			// read only after Wait: the process writes it until then.
			wrote := assert.Eventually(t, func() bool {
				if to == "-" {
					st, err := f.Stat()
					return err == nil && st.Size() > 4096
				}
				entries, _ := os.ReadDir(out)
				return len(entries) >= 2
			}, 30*time.Second, 5*time.Millisecond)
			require.NoError(t, cmd.Process.Kill())
			_ = cmd.Wait()
			require.True(t, wrote, "the backup wrote nothing: %s", stderr.String())

			o := backupcmd.RestoreOptions{From: out, DataDir: target, Force: true}
			if to == "-" {
				stream, err := os.ReadFile(stdout)
				require.NoError(t, err)
				o.From, o.Stdin = "-", bytes.NewReader(stream)
			}
			_, err = backupcmd.RunRestore(ctx, o)
			require.ErrorIs(t, err, backupcmd.ErrIncomplete)
			require.Equal(t, before, treeDigest(t, target), "the data directory changed")
			leftovers, _ := filepath.Glob(target + ".restore-*")
			require.Empty(t, leftovers)
		})
	}

	// Without Force a data directory with files is refused.
	_, err = backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: "-", Stdin: bytes.NewReader(full), DataDir: target})
	require.ErrorIs(t, err, pebble.ErrNotEmpty)
	require.Equal(t, before, treeDigest(t, target))
	// With Force, the data directory a serve holds is refused.
	_, err = backupcmd.RunRestore(ctx, backupcmd.RestoreOptions{From: "-", Stdin: bytes.NewReader(full), DataDir: filepath.Join(parent, "data"), Force: true})
	require.ErrorIs(t, err, pebble.ErrLocked)
	leftovers, _ := filepath.Glob(filepath.Join(parent, "data.restore-*"))
	require.Empty(t, leftovers)
}

// treeDigest is the SHA-256 of every file under dir, by path.
func treeDigest(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(b)
		out[path] = hex.EncodeToString(sum[:])
		return nil
	}))
	return out
}

// buildBackupMain builds testdata/backupmain: backupcmd.Run with every
// ReadBackup cut to 4 KiB and delayed by $BACKUP_TEST_READ_DELAY, so that
// a test can kill it midway.
func buildBackupMain(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "backupmain")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/backupmain")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	return bin
}
