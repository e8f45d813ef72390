// Package pgrestore checks what a PostgreSQL backup brings back (issue 40,
// item 3): a pg_dump taken while Claims and Completes run, restored with
// pg_restore into a fresh database, and a registry started on it. The
// procedure it follows is docs/operations/runbooks.md's "Back up and
// restore PostgreSQL".
package pgrestore

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

const consumer = "restore.test"

// pgTool finds a PostgreSQL client program: on the PATH, else in the
// Debian packages' /usr/lib/postgresql/*/bin (the newest version).
func pgTool(t *testing.T, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	if len(found) == 0 {
		t.Skipf("%s is neither on the PATH nor in /usr/lib/postgresql/*/bin: install the PostgreSQL client programs", name)
	}
	sort.Strings(found)
	return found[len(found)-1]
}

// registry is a registry server on a PostgreSQL database, in this process.
type registry struct {
	rpc idemregv1.RegistryServiceClient
	url string
}

func start(t *testing.T, databaseURL string) registry {
	t.Helper()
	store, err := postgres.Open(t.Context(), databaseURL)
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	srv, err := server.New(store, server.Config{})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-served) })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return registry{rpc: idemregv1.NewRegistryServiceClient(conn), url: databaseURL}
}

// held is a claim someone holds: what its Complete needs.
type held struct {
	key    string
	token  int64
	secret []byte
}

func (r registry) claim(ctx context.Context, key string, lease time.Duration) (*idemregv1.ClaimResponse, error) {
	return r.rpc.Claim(ctx, &idemregv1.ClaimRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Fingerprint: []byte("fp"),
		Lease: durationpb.New(lease), Retention: durationpb.New(time.Hour), Holder: "restore-test",
	})
}

func (r registry) acquire(t *testing.T, key string, lease time.Duration) held {
	t.Helper()
	res, err := r.claim(t.Context(), key, lease)
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome(), key)
	return held{key, res.GetToken(), res.GetClaimSecret()}
}

func result(key string) []byte { return []byte("result of " + key) }

func (r registry) complete(ctx context.Context, h held) error {
	_, err := r.rpc.Complete(ctx, &idemregv1.CompleteRequest{
		Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: h.key, Token: h.token, ClaimSecret: h.secret,
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "restore.v1.Done", Data: result(h.key)}}},
	})
	return err
}

// tokens keeps the greatest token the first database ever issued,
// including on the timeline the restore throws away.
type tokens struct{ max atomic.Int64 }

func (m *tokens) saw(tok int64) {
	for {
		cur := m.max.Load()
		if tok <= cur || m.max.CompareAndSwap(cur, tok) {
			return
		}
	}
}

// TestRestorePgDump backs a registry's database up with pg_dump while
// Claims and Completes run, goes on using the old database (the lost
// timeline), restores the dump into a fresh database with pg_restore and
// starts a registry on it, and checks the three properties issue 40 asks
// of a restore: every Complete acknowledged before the dump began
// replays; every token issued after the restore is greater than every
// token issued before it, the lost timeline's included, so that a holder
// from that timeline is refused; a claim secret issued before the dump
// still completes its claim.
func TestRestorePgDump(t *testing.T) {
	pgDump, pgRestore := pgTool(t, "pg_dump"), pgTool(t, "pg_restore")
	ctx := t.Context()
	old := start(t, pgtest.NewDatabase(t))
	var issued tokens

	// Before the dump: completed keys, and claims held with a long lease
	// (their secrets are used after the restore) or a short one (taken
	// over on the lost timeline).
	var acked []string
	for i := range 50 {
		h := old.acquire(t, fmt.Sprintf("before-%d", i), time.Minute)
		issued.saw(h.token)
		require.NoError(t, old.complete(ctx, h))
		acked = append(acked, h.key)
	}
	heldBefore := old.acquire(t, "held-before", 10*time.Minute)
	forgedBefore := old.acquire(t, "held-before-forged", 10*time.Minute)
	shortBefore := old.acquire(t, "held-before-short-lease", time.Second)
	for _, h := range []held{heldBefore, forgedBefore, shortBefore} {
		issued.saw(h.token)
	}

	// Load through the dump: callers claim and complete new keys until it
	// ends. A Complete acknowledged before pg_dump started must be in the
	// dump; those after may or may not be.
	var (
		mu          sync.Mutex
		ackedBefore []string // acknowledged before the dump began
		ackedDuring []string
		dumping     atomic.Bool
		stop        atomic.Bool
		loadErr     error
		done        = make(chan struct{})
	)
	var running sync.WaitGroup
	var ops atomic.Int64
	for w := range 4 {
		running.Go(func() {
			for i := 0; !stop.Load(); i++ {
				key := fmt.Sprintf("load-%d-%d", w, i)
				res, err := old.claim(ctx, key, time.Minute)
				if err == nil {
					issued.saw(res.GetToken())
					err = old.complete(ctx, held{key, res.GetToken(), res.GetClaimSecret()})
				}
				wasDumping := dumping.Load()
				mu.Lock()
				switch {
				case err != nil:
					loadErr = err
				case wasDumping:
					ackedDuring = append(ackedDuring, key)
				default:
					ackedBefore = append(ackedBefore, key)
				}
				mu.Unlock()
				ops.Add(1)
			}
		})
	}
	go func() { running.Wait(); close(done) }()
	require.Eventually(t, func() bool { return ops.Load() >= 40 }, 30*time.Second, 10*time.Millisecond, "the load runs")
	dump := filepath.Join(t.TempDir(), "idemreg.dump")
	// dumping is set before pg_dump starts: whatever was acknowledged
	// before it was committed before the dump's snapshot was taken.
	dumping.Store(true)
	out, err := exec.CommandContext(ctx, pgDump, "--format=custom", "--file="+dump, "--dbname="+old.url).CombinedOutput()
	require.NoError(t, err, "pg_dump: %s", out)
	stop.Store(true)
	<-done
	require.NoError(t, loadErr)
	mu.Lock()
	acked = append(acked, ackedBefore...)
	t.Logf("acknowledged before the dump began: %d Completes; while it ran: %d", len(acked), len(ackedDuring))
	mu.Unlock()

	// The lost timeline: the old database goes on after the dump.
	var lost []string
	for i := range 20 {
		h := old.acquire(t, fmt.Sprintf("lost-%d", i), time.Minute)
		issued.saw(h.token)
		require.NoError(t, old.complete(ctx, h))
		lost = append(lost, h.key)
	}
	lostHolder := old.acquire(t, "lost-holder", 10*time.Minute)
	lostHolderLater := old.acquire(t, "lost-holder-later", 10*time.Minute)
	time.Sleep(1100 * time.Millisecond) // shortBefore's lease runs out
	lostTakeover := old.acquire(t, shortBefore.key, 10*time.Minute)
	require.Greater(t, lostTakeover.token, shortBefore.token)
	for _, h := range []held{lostHolder, lostHolderLater, lostTakeover} {
		issued.saw(h.token)
	}

	// Restore into a fresh database and serve it.
	restoredURL := pgtest.NewEmptyDatabase(t)
	out, err = exec.CommandContext(ctx, pgRestore, "--no-owner", "--exit-on-error", "--dbname="+restoredURL, dump).CombinedOutput()
	require.NoError(t, err, "pg_restore: %s", out)
	restored := start(t, restoredURL)
	maxBefore := issued.max.Load()

	// 1. Every Complete acknowledged before the dump began replays, with
	// its result.
	for _, key := range acked {
		res, err := restored.claim(ctx, key, time.Minute)
		require.NoError(t, err, key)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome(), key)
		require.Equal(t, result(key), res.GetRecord().GetResult().GetResponse().GetData(), key)
	}
	// A Complete acknowledged while the dump ran is in it or not: replayed
	// with its result; claimed in the dump and completed after it, so in
	// progress under the claim's lease (a takeover after it is attempt 2);
	// or unknown to it, so run again.
	inDump, claimedInDump := 0, 0
	for _, key := range ackedDuring {
		res, err := restored.claim(ctx, key, time.Minute)
		require.NoError(t, err, key)
		switch res.GetOutcome() {
		case idemregv1.Outcome_OUTCOME_COMPLETED:
			require.Equal(t, result(key), res.GetRecord().GetResult().GetResponse().GetData(), key)
			inDump++
		case idemregv1.Outcome_OUTCOME_IN_PROGRESS:
			claimedInDump++
		case idemregv1.Outcome_OUTCOME_ACQUIRED:
			require.Greater(t, res.GetToken(), maxBefore, key)
		default:
			t.Fatalf("%s, completed while the dump ran, answered %s", key, res.GetOutcome())
		}
	}
	t.Logf("of the %d acknowledged while the dump ran, %d were completed in it, %d claimed", len(ackedDuring), inDump, claimedInDump)

	// 2. Tokens after the restore exceed every token before it, and the
	// lost timeline's holders are refused. A holder whose key the dump
	// does not know: refused before anyone claims it again, and after.
	refused := func(h held, want codes.Code, wantReason string) {
		t.Helper()
		err := restored.complete(ctx, h)
		require.Equal(t, want, status.Code(err), "Complete of %s with the lost timeline's token %d: %v", h.key, h.token, err)
		require.Equal(t, wantReason, reason(err), "Complete of %s: %v", h.key, err)
	}
	refused(lostHolder, codes.NotFound, "NOT_FOUND")
	again := restored.acquire(t, lostHolderLater.key, time.Minute)
	require.Greater(t, again.token, maxBefore)
	refused(lostHolderLater, codes.FailedPrecondition, "LEASE_LOST")
	// A key the dump holds as claimed, taken over on the lost timeline:
	// that holder is refused, and the key's next token exceeds its.
	refused(lostTakeover, codes.FailedPrecondition, "LEASE_LOST")
	takeover := restored.acquire(t, shortBefore.key, time.Minute)
	require.Greater(t, takeover.token, maxBefore)
	refused(lostTakeover, codes.FailedPrecondition, "LEASE_LOST")
	// Keys completed only on the lost timeline run again, as new keys.
	for _, key := range lost {
		h := restored.acquire(t, key, time.Minute)
		require.Greater(t, h.token, maxBefore, key)
	}
	for i := range 20 {
		h := restored.acquire(t, fmt.Sprintf("after-%d", i), time.Minute)
		require.Greater(t, h.token, maxBefore)
	}

	// 3. A claim secret issued before the dump completes its claim; one
	// altered is refused, so the check is not vacuous.
	forged := forgedBefore
	forged.secret = bytes.Clone(forged.secret)
	forged.secret[0] ^= 0xff
	err = restored.complete(ctx, forged)
	require.Equal(t, "CLAIM_SECRET_INVALID", reason(err), "a forged claim secret: %v", err)
	require.NoError(t, restored.complete(ctx, heldBefore), "the claim secret issued before the dump")
	res, err := restored.claim(ctx, heldBefore.key, time.Minute)
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome())
}

// reason is the ErrorInfo reason of err's status, or "".
func reason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}
