package faults

import (
	"context"
	"fmt"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestServeSurvivesSIGKILL kills a real `idemreg serve` on the embedded
// store with SIGKILL in the middle of a stream of Claims and Completes,
// restarts it on the same data directory, and checks that every acknowledged
// Complete is there with its result and every acknowledged token still
// fences its key.
func TestServeSurvivesSIGKILL(t *testing.T) {
	bin := servetest.Binary(t)
	dir := t.TempDir()
	p := servetest.Start(t, bin, dir, nil, "--data-dir", dir+"/data")
	p.WaitLog(t, "serving")
	c := idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))

	type acked struct {
		key      string
		token    int64
		secret   []byte
		complete bool
	}
	var (
		mu   sync.Mutex
		acks []acked
	)
	result := func(key string) *idemregv1.Result {
		return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "crash.Test", Data: []byte("result-of-" + key)}}}
	}
	const consumer = "crash.test"
	kind := idemregv1.Kind_KIND_OPERATION

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: key, Lease: durationSeconds(3600)})
				if err != nil {
					return // the server died
				}
				mu.Lock()
				acks = append(acks, acked{key: key, token: res.GetToken(), secret: res.GetClaimSecret()})
				mu.Unlock()
				if i%4 == 3 {
					continue // leave some claims in progress
				}
				if _, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(), Result: result(key)}); err != nil {
					return
				}
				mu.Lock()
				acks = append(acks, acked{key: key, token: res.GetToken(), secret: res.GetClaimSecret(), complete: true})
				mu.Unlock()
			}
		})
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(acks) >= 600 }, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, p.Cmd.Process.Signal(syscall.SIGKILL))
	err := p.Cmd.Wait()
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr, "the server was killed")
	wg.Wait()

	p = servetest.Start(t, bin, dir, nil, "--data-dir", dir+"/data")
	p.WaitLog(t, "serving")
	c = idemregv1.NewRegistryServiceClient(servetest.Dial(t, p.Addr))

	mu.Lock()
	defer mu.Unlock()
	completed := map[string]bool{}
	for _, a := range acks {
		if a.complete {
			completed[a.key] = true
		}
	}
	checked := 0
	for _, a := range acks {
		if a.complete {
			continue
		}
		got, err := c.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: a.key})
		require.NoError(t, err, "acknowledged claim %s lost", a.key)
		if completed[a.key] {
			require.Equal(t, idemregv1.State_STATE_COMPLETED, got.GetRecord().GetState())
			require.Equal(t, a.token, got.GetRecord().GetToken())
			require.Equal(t, "result-of-"+a.key, string(got.GetRecord().GetResult().GetResponse().GetData()))
		}
		// The acknowledged token still fences the key: an older one is refused.
		_, err = c.Complete(t.Context(), &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: a.key, Token: a.token - 1, ClaimSecret: a.secret, Result: result("zombie")})
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "key %s", a.key)
		// And a Claim does not hand the key to someone else.
		res, err := c.Claim(t.Context(), &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: a.key})
		require.NoError(t, err)
		require.NotEqual(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome(), "key %s acquired twice", a.key)
		if !completed[a.key] {
			// The holder's claim secret survived the restart.
			_, err = c.Complete(t.Context(), &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: a.key, Token: a.token, ClaimSecret: a.secret, Result: result(a.key)})
			require.NoError(t, err, "key %s: the holder completes after the restart", a.key)
		}
		checked++
	}
	t.Logf("checked %d acknowledged claims (%d completed) after SIGKILL", checked, len(completed))

	// A second server on the same data directory is refused with a clear error.
	second := exec.Command(bin, "serve", "--listen", servetest.FreeAddr(t), "--data-dir", dir+"/data")
	out, err := second.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "locked")
}

func durationSeconds(s int64) *durationpb.Duration { return &durationpb.Duration{Seconds: s} }
