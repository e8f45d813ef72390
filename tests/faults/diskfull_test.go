package faults

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/internal/tmpfs"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/tests/pgcluster"
)

// refusal is what a caller can read of an error status.
type refusal struct {
	code   codes.Code
	reason string
	meta   map[string]string
	retry  time.Duration
}

func refusalOf(err error) refusal {
	st := status.Convert(err)
	r := refusal{code: st.Code()}
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			r.reason, r.meta = d.GetReason(), d.GetMetadata()
		case *errdetails.RetryInfo:
			r.retry = d.GetRetryDelay().AsDuration()
		}
	}
	return r
}

func healthOf(t *testing.T, p *servetest.Process) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	res, err := healthpb.NewHealthClient(servetest.Dial(t, p.Addr)).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return res.GetStatus()
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	res, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return string(b)
}

// TestServeOnFullDisk runs `idemreg serve` on the embedded store with its
// data directory on a 64 MiB tmpfs and fills it, as issue 28 did:
//
//   - before the reserve: a WARN line and the gauges say how much is left;
//   - below it: new keys get RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED
//     (resource disk, RetryInfo), held keys complete, reads replay,
//     health stays SERVING;
//   - the file system grows: new keys are accepted again;
//   - another writer fills the file system: the WAL write fails, callers
//     get UNAVAILABLE with RetryInfo (never INTERNAL), health turns
//     NOT_SERVING, serve exits with status 75 and says why;
//   - the space freed, serve starts again and every acknowledged result
//     is there.
func TestServeOnFullDisk(t *testing.T) {
	fs := tmpfs.Mount(t, 64<<20)
	bin := servetest.Binary(t)
	data := filepath.Join(fs.Dir, "data")
	metrics := servetest.FreeAddr(t)
	args := []string{"--data-dir", data, "--data-dir-reserve", fmt.Sprint(16 << 20), "--metrics-listen", metrics, "--drain-delay", "3s"}
	p := servetest.Start(t, bin, t.TempDir(), nil, args...)
	p.Quiet.Store(true)
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	ctx := t.Context()
	const consumer = "disk.test"
	kind := idemregv1.Kind_KIND_OPERATION
	result := func(key string, n int) *idemregv1.Result {
		b := make([]byte, n)
		_, _ = rand.NewChaCha8([32]byte([]byte(fmt.Sprintf("%-32.32s", key)))).Read(b)
		return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "disk.Test", Data: b}}}
	}
	type claim struct {
		token  int64
		secret []byte
	}
	claimKey := func(key string) (claim, error) {
		res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: key, Lease: durationSeconds(3600)})
		if err == nil && res.GetOutcome() != idemregv1.Outcome_OUTCOME_ACQUIRED {
			err = fmt.Errorf("claim of %s: %v", key, res.GetOutcome())
		}
		return claim{res.GetToken(), res.GetClaimSecret()}, err
	}
	complete := func(key string, cl claim, n int) error {
		_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: cl.token, ClaimSecret: cl.secret, Result: result(key, n)})
		return err
	}

	held := map[string]claim{}
	for i := range 8 {
		k := fmt.Sprintf("held-%d", i)
		cl, err := claimKey(k)
		require.NoError(t, err)
		held[k] = cl
	}
	acked := map[string]int{} // key → size of its acknowledged result
	var refused error
	for i := 0; ; i++ {
		require.Less(t, i, 1000, "serve never refused a new key on a 64 MiB file system")
		k := fmt.Sprintf("fill-%d", i)
		cl, err := claimKey(k)
		if err != nil {
			refused = err
			break
		}
		require.NoError(t, complete(k, cl, 256<<10))
		acked[k] = 256 << 10
	}
	r := refusalOf(refused)
	t.Logf("%d results of 256 KiB acknowledged, then %v", len(acked), refused)
	require.Equal(t, codes.ResourceExhausted, r.code, "%v", refused)
	require.Equal(t, idemregv1.ReasonCapacityExhausted, r.reason)
	require.Equal(t, "disk", r.meta["resource"])
	require.Positive(t, r.retry, "RetryInfo")

	// The operator was told before: the WARN line, then the refusal's.
	warn := p.WaitLog(t, "data directory short of space: new keys will be refused below the reserve")
	for _, f := range []string{"free_bytes", "store_bytes", "reserve_bytes"} {
		require.Contains(t, warn, f)
	}
	p.WaitLog(t, "data directory below its reserve: refusing Claims that would start an attempt; Completes, Releases, Extends and reads go on")
	m := scrape(t, metrics)
	for _, g := range []string{"idemreg_store_disk_free_bytes", "idemreg_store_size_bytes", "idemreg_store_disk_reserve_bytes{", "idemreg_store_disk_refusing"} {
		require.Contains(t, m, g)
	}
	require.Contains(t, m, `error_type="exhausted"`, "the refusals count in idemreg_store_errors_total")

	// Held keys complete, replays and reads go on, health stays SERVING.
	for k, cl := range held {
		if k == "held-0" {
			continue // extended below
		}
		require.NoError(t, complete(k, cl, 1024), "a held key completes below the reserve")
		acked[k] = 1024
	}
	for k, n := range acked {
		res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: k, Lease: durationSeconds(3600)})
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, res.GetOutcome())
		require.Len(t, res.GetRecord().GetResult().GetResponse().GetData(), n)
	}
	// A flush deletes the WAL it came from, which can lift the free
	// space back over the reserve: shrink the file system to keep it
	// below while health is watched.
	var st syscall.Statfs_t
	require.NoError(t, syscall.Statfs(fs.Dir, &st))
	fs.Resize(t, int64(st.Blocks-st.Bfree)*st.Bsize+10<<20)
	refusedCalls := 0
	for i := range 3 { // three health intervals, with calls refused in between
		for j := range 10 {
			_, err := claimKey(fmt.Sprintf("refused-%d-%d", i, j))
			if status.Code(err) == codes.ResourceExhausted {
				refusedCalls++
			}
		}
		time.Sleep(2 * time.Second)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, healthOf(t, p), "refusals for the disk do not make serve unready")
	}
	require.GreaterOrEqual(t, refusedCalls, 20, "enough refusals to turn readiness if they counted as failures")

	// The file system grows: new keys again.
	fs.Resize(t, 160<<20)
	var grown claim
	require.Eventually(t, func() bool {
		var err error
		grown, err = claimKey("after-grow")
		return err == nil
	}, 10*time.Second, 50*time.Millisecond, "new keys accepted once the file system grew")
	require.NoError(t, complete("after-grow", grown, 256<<10))
	acked["after-grow"] = 256 << 10
	p.WaitLog(t, "data directory has free space again")

	// A clean restart (SIGTERM: exit 0), so that the WAL the store writes
	// next is a new one, not one pebble recycles (whose blocks are
	// already allocated and would take the writes below whatever the
	// file system has left).
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, p.Cmd.Wait(), "serve exits 0 on SIGTERM")
	p = servetest.Start(t, bin, t.TempDir(), nil, args...)
	p.Quiet.Store(true)
	p.WaitLog(t, "serving")
	c = idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))

	// Another writer fills the file system and takes whatever the store
	// frees: the WAL write fails.
	filler, stopHog := fs.Hog(t, "filler")
	hc := held["held-0"]
	var failed error
	for i := 0; i < 100_000; i++ {
		_, err := c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: "held-0", Token: hc.token, ClaimSecret: hc.secret, Lease: durationSeconds(3000 + int64(i%600))})
		if err != nil && status.Code(err) != codes.ResourceExhausted {
			failed = err
			break
		}
	}
	require.Error(t, failed, "the WAL never failed on a full file system")
	t.Logf("the store failed under an Extend: %v", failed)
	r = refusalOf(failed)
	require.Equal(t, codes.Unavailable, r.code, "never INTERNAL: %v", failed)
	require.Equal(t, idemregv1.ReasonStoreUnavailable, r.reason)
	require.Positive(t, r.retry)
	require.Eventually(t, func() bool { return healthOf(t, p) == healthpb.HealthCheckResponse_NOT_SERVING },
		time.Second, 10*time.Millisecond, "health turns NOT_SERVING at once")
	_, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: "fill-0"})
	r = refusalOf(err)
	require.Equal(t, codes.Unavailable, r.code, "while it drains, every call is UNAVAILABLE: %v", err)
	require.Positive(t, r.retry)
	p.WaitLog(t, "store failed: not serving, stopping so that the process exits and its supervisor restarts it")
	err = p.Cmd.Wait()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 75, exit.ExitCode(), "serve exits with EX_TEMPFAIL for its supervisor")

	// Space is freed; the supervisor starts serve again.
	stopHog()
	require.NoError(t, os.Remove(filler))
	p = servetest.Start(t, bin, t.TempDir(), nil, args...)
	p.Quiet.Store(true)
	p.WaitLog(t, "serving")
	c = idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	require.Eventually(t, func() bool { return healthOf(t, p) == healthpb.HealthCheckResponse_SERVING }, 10*time.Second, 50*time.Millisecond)
	for k, n := range acked {
		res, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: k})
		require.NoError(t, err, "acknowledged %s lost", k)
		require.Equal(t, idemregv1.State_STATE_COMPLETED, res.GetRecord().GetState(), k)
		require.Equal(t, result(k, n).GetResponse().GetData(), res.GetRecord().GetResult().GetResponse().GetData(), k)
	}
	res, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: "held-0"})
	require.NoError(t, err)
	require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, res.GetRecord().GetState(), "the extended key is still held")
	require.NoError(t, complete("held-0", hc, 1024), "its holder completes it after the restart")
	_, err = claimKey("after-restart")
	require.NoError(t, err)
}

// TestServeOnFullDatabaseDisk runs `idemreg serve` on PostgreSQL (a
// cluster the test owns: a full tablespace fails the server's
// checkpoints, which other tests' DROP DATABASE needs) whose tablespace is
// a 48 MiB tmpfs and fills it: callers get
// RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED (resource disk, RetryInfo), not
// STORE_UNAVAILABLE; reads answer and health stays SERVING; once the file
// system grows the held keys complete and new keys are taken, with no
// restart, and every acknowledged result is there.
func TestServeOnFullDatabaseDisk(t *testing.T) {
	cluster := pgcluster.Start(t)
	dbURL, fs := pgtest.NewDatabaseOnTmpfsAt(t, cluster.URL(cluster.Addr(), "postgres"), 48<<20)
	bin := servetest.Binary(t)
	p := servetest.Start(t, bin, t.TempDir(), []string{"IDEMREG_DATABASE_URL=" + dbURL})
	p.Quiet.Store(true)
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))
	ctx := t.Context()
	const consumer = "disk.test"
	kind := idemregv1.Kind_KIND_OPERATION
	result := func(key string, n int) *idemregv1.Result {
		b := make([]byte, n)
		_, _ = rand.NewChaCha8([32]byte([]byte(fmt.Sprintf("%-32.32s", key)))).Read(b)
		return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "disk.Test", Data: b}}}
	}
	type claim struct {
		token  int64
		secret []byte
	}
	held := map[string]claim{}
	acked := map[string]int{}
	var full error
	for i := 0; full == nil; i++ {
		require.Less(t, i, 1000, "the database never reported its disk full")
		k := fmt.Sprintf("fill-%d", i)
		res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: k, Lease: durationSeconds(3600)})
		if err != nil {
			full = err
			break
		}
		cl := claim{res.GetToken(), res.GetClaimSecret()}
		if _, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: k, Token: cl.token, ClaimSecret: cl.secret, Result: result(k, 256<<10)}); err != nil {
			full = err
			held[k] = cl
			break
		}
		acked[k] = 256 << 10
	}
	r := refusalOf(full)
	t.Logf("%d results of 256 KiB acknowledged, then %v", len(acked), full)
	require.Equal(t, codes.ResourceExhausted, r.code, "%v", full)
	require.Equal(t, idemregv1.ReasonCapacityExhausted, r.reason)
	require.Equal(t, "disk", r.meta["resource"])
	require.Positive(t, r.retry)
	for k := range acked {
		_, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: k})
		require.NoError(t, err, "reads answer while the disk is full")
		break
	}
	for range 3 { // three health intervals of refused calls
		for j := range 10 {
			_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: fmt.Sprintf("refused-%d", j), Lease: durationSeconds(60)})
			if err == nil {
				continue // a small row may still fit a page
			}
			require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		}
		time.Sleep(2 * time.Second)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, healthOf(t, p), "a full database disk does not make serve unready")
	}

	fs.Resize(t, 128<<20)
	for k, cl := range held {
		_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: k, Token: cl.token, ClaimSecret: cl.secret, Result: result(k, 1024)})
		require.NoError(t, err, "the held key completes once there is space")
		acked[k] = 1024
	}
	res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: "after-grow", Lease: durationSeconds(60)})
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
	for k, n := range acked {
		res, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: k})
		require.NoError(t, err, "acknowledged %s lost", k)
		require.Equal(t, result(k, n).GetResponse().GetData(), res.GetRecord().GetResult().GetResponse().GetData(), k)
	}
}
