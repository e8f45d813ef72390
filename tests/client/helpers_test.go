package client_test

import (
	"context"
	"path"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/tests/internal/inprocess"
)

// hangGuard ends a wait that would otherwise hang until the test binary's
// timeout; no test passes or fails on how long a wait takes below it.
const hangGuard = 30 * time.Second

// recv receives from ch, failing the test instead of hanging.
func recv[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangGuard):
		t.Fatalf("nothing received after %v", hangGuard)
		panic("unreachable")
	}
}

// shortLeases lets tests claim leases of a few tens of milliseconds, so
// heartbeats and real lease expiry happen within a fast test.
func shortLeases() inprocess.Option {
	l := inprocess.DefaultLimits()
	l.MinLease = 10 * time.Millisecond
	return inprocess.WithLimits(l)
}

// observer watches the calls a client makes to the registry: how many
// Claims answered IN_PROGRESS and which outgoing metadata they carried. Tests
// wait on it instead of sleeping.
type observer struct {
	mu         sync.Mutex
	inProgress int
	// sent counts the calls sent, by method name ("Claim", "BatchClaim",
	// ...), counted before they reach the registry.
	sent     map[string]int
	sizes    []sentSize
	changed  chan struct{}
	metadata []metadata.MD
}

// observedClient is a client of reg whose registry calls the observer sees.
func observedClient(t *testing.T, reg *inprocess.Registry, opts ...client.ClientOption) (*client.Client, *observer) {
	t.Helper()
	o := newObserver()
	conn, err := grpc.NewClient(reg.Addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
			o.record(method, req)
			err := invoker(ctx, method, req, reply, cc, callOpts...)
			md, _ := metadata.FromOutgoingContext(ctx)
			o.mu.Lock()
			defer o.mu.Unlock()
			o.metadata = append(o.metadata, md)
			if r, ok := reply.(*idemregv1.ClaimResponse); ok && err == nil && r.GetOutcome() == idemregv1.Outcome_OUTCOME_IN_PROGRESS {
				o.inProgress++
				close(o.changed)
				o.changed = make(chan struct{})
			}
			return err
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return client.New(conn, opts...), o
}

func newObserver() *observer { return &observer{changed: make(chan struct{}), sent: map[string]int{}} }

// record counts a call of method as sent.
func (o *observer) record(method string, req any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.sent[path.Base(method)]++
	o.sizes = append(o.sizes, sentSize{path.Base(method), batchSize(req)})
	close(o.changed)
	o.changed = make(chan struct{})
}

// sentCount is how many calls of method were sent.
func (o *observer) sentCount(method string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.sent[method]
}

// waitSent blocks until at least n calls of method were sent.
func (o *observer) waitSent(t *testing.T, method string, n int) {
	t.Helper()
	for {
		o.mu.Lock()
		got, ch := o.sent[method], o.changed
		o.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-ch:
		case <-time.After(hangGuard):
			t.Fatalf("no %d %s calls after %v", n, method, hangGuard)
		}
	}
}

type sentSize struct {
	method string
	items  int
}

// batchSize is the number of items of a batch request, 1 for another.
func batchSize(req any) int {
	switch r := req.(type) {
	case *idemregv1.BatchClaimRequest:
		return len(r.GetRequests())
	case *idemregv1.BatchCompleteRequest:
		return len(r.GetRequests())
	}
	return 1
}

// sentSizes returns the item counts of the calls of method sent so far.
func (o *observer) sentSizes(method string) []int {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []int
	for _, s := range o.sizes {
		if s.method == method {
			out = append(out, s.items)
		}
	}
	return out
}

func (o *observer) inProgressAnswers() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.inProgress
}

func (o *observer) allMetadata() []metadata.MD {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]metadata.MD(nil), o.metadata...)
}

// eventually polls cond until it holds or the test's context ends; for
// conditions only the registry can tell (a lease moved), where there is no
// signal to wait on.
func eventually(t *testing.T, cond func() bool, what string) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	guard := time.After(hangGuard)
	for !cond() {
		select {
		case <-tick.C:
		case <-guard:
			t.Fatalf("still waiting for %s after %v", what, hangGuard)
		}
	}
}

// gatedClient is a client of reg whose first Claim reaches the registry but
// whose answer is held back until open is called: a Claim in flight when
// the caller's deadline hits.
func gatedClient(t *testing.T, reg *inprocess.Registry) (c *client.Client, sent <-chan struct{}, open func()) {
	t.Helper()
	sentc, gate := make(chan struct{}), make(chan struct{})
	var once sync.Once
	conn, err := grpc.NewClient(reg.Addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
			err := invoker(ctx, method, req, reply, cc, callOpts...)
			if _, ok := req.(*idemregv1.ClaimRequest); ok {
				first := false
				once.Do(func() { first = true })
				if first {
					close(sentc)
					<-gate
				}
			}
			return err
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	var openOnce sync.Once
	return client.New(conn), sentc, func() { openOnce.Do(func() { close(gate) }) }
}

// lossyClient is a client of reg whose first `lose` Claims reach the
// registry and take effect, but whose replies are lost: the caller sees
// UNAVAILABLE. It returns the request ids of every Claim it sent.
func lossyClient(t *testing.T, reg *inprocess.Registry, lose int32) (*client.Client, func() []string) {
	t.Helper()
	var (
		mu  sync.Mutex
		ids []string
		n   atomic.Int32
	)
	conn, err := grpc.NewClient(reg.Addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
			err := invoker(ctx, method, req, reply, cc, callOpts...)
			if r, ok := req.(*idemregv1.ClaimRequest); ok {
				mu.Lock()
				ids = append(ids, r.GetRequestId())
				mu.Unlock()
				if err == nil && n.Add(1) <= lose {
					return status.Error(codes.Unavailable, "test: the reply was lost")
				}
			}
			return err
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return client.New(conn), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), ids...)
	}
}
