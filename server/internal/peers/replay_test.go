package peers

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/storage"
)

// wire is a real gRPC server on loopback answering Wake with a Receiver,
// which keeps every sealed request it was sent: what anyone on the path
// between two replicas could capture.
type wire struct {
	addr string

	mu       sync.Mutex
	captured [][]byte
	woken    []storage.Key
	results  []string
}

func serveWire(t *testing.T, self string, keys Keys, opts ...ReceiverOption) *wire {
	t.Helper()
	w := &wire{}
	capture := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		w.mu.Lock()
		w.captured = append(w.captured, append([]byte(nil), req.(*wrapperspb.BytesValue).GetValue()...))
		w.mu.Unlock()
		return next(ctx, req)
	}
	opts = append(opts, WithCount(func(result string) {
		w.mu.Lock()
		w.results = append(w.results, result)
		w.mu.Unlock()
	}))
	g := grpc.NewServer(grpc.UnaryInterceptor(capture))
	Register(g, NewReceiver(self, keys, func(k storage.Key) {
		w.mu.Lock()
		w.woken = append(w.woken, k)
		w.mu.Unlock()
	}, opts...))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	w.addr = lis.Addr().String()
	return w
}

// tell has a Sender of replica "a" tell key to "b" at w and waits until
// w took it.
func (w *wire) tell(t *testing.T, keys Keys, k storage.Key) {
	t.Helper()
	told := make(chan string, 1)
	// A timeout far over DefaultTimeout: on a loaded machine under -race
	// the first call, dial included, can take longer than 250 ms.
	s := NewSender(t.Context(), SenderConfig{Self: "a", Keys: keys, Creds: insecure.NewCredentials(), Timeout: 30 * time.Second,
		Address: func(string) (string, bool) { return w.addr, true },
		Count:   func(result string, _ int) { told <- result }})
	s.Tell(k, []string{"b"})
	require.Equal(t, Sent, <-told)
}

func (w *wire) state() (captured [][]byte, woken []storage.Key, results []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([][]byte(nil), w.captured...), append([]storage.Key(nil), w.woken...), append([]string(nil), w.results...)
}

// replay sends a captured message again, as whoever captured it would.
func replay(t *testing.T, addr string, msg []byte) error {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	return conn.Invoke(t.Context(), wakeMethod, wrapperspb.Bytes(msg), new(emptypb.Empty))
}

func requireRefusedWake(t *testing.T, err error, why string) {
	t.Helper()
	st := status.Convert(err)
	require.Equal(t, codes.PermissionDenied, st.Code(), "%v", err)
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			require.Equal(t, "PERMISSION_DENIED", info.GetReason())
			require.Equal(t, why, info.GetMetadata()["wake"])
			return
		}
	}
	t.Fatalf("no ErrorInfo in %v", err)
}

// TestWakeReplayRefused (issue 35, weakness 3): a Wake a Sender really
// sent, captured on the wire, is refused when sent again, at once (the
// sequence was taken) and after the freshness window (stale, even by a
// receiver that restarted and forgot what it took), and wakes nothing;
// the next genuine Wake, from a sender restarted with the same ID too, is
// still taken.
func TestWakeReplayRefused(t *testing.T) {
	keys := ring{current: 1, keys: map[int64][]byte{1: key(1)}}
	k := storage.Key{Consumer: "c", Kind: storage.KindOperation, Key: "k"}
	w := serveWire(t, "b", keys)

	w.tell(t, keys, k)
	captured, woken, _ := w.state()
	require.Len(t, captured, 1)
	require.Equal(t, []storage.Key{k}, woken, "the genuine Wake wakes its key")

	for range 100 {
		requireRefusedWake(t, replay(t, w.addr, captured[0]), Replayed)
	}
	_, woken, results := w.state()
	require.Len(t, woken, 1, "a replay wakes nothing")
	require.Equal(t, 100, countOf(results, Replayed), "each replay counted")

	// A new Sender with the same ID (a restarted replica): its sequence
	// is its clock, past the last one taken.
	w.tell(t, keys, k)
	_, woken, _ = w.state()
	require.Len(t, woken, 2, "a restarted sender's Wake is taken")

	// A receiver restarted forgets the sequences it took: the window is
	// what refuses the message then.
	restarted := serveWire(t, "b", keys, WithClock(func() time.Time { return time.Now().Add(DefaultFreshness + time.Second) }))
	requireRefusedWake(t, replay(t, restarted.addr, captured[0]), Stale)
	_, woken, results = restarted.state()
	require.Empty(t, woken)
	require.Equal(t, []string{Stale}, results)

	// And one whose sender's clock is ahead of it by more than the
	// window.
	behind := serveWire(t, "b", keys, WithClock(func() time.Time { return time.Now().Add(-DefaultFreshness - time.Second) }))
	requireRefusedWake(t, replay(t, behind.addr, captured[0]), Stale)
}

func countOf(results []string, result string) int {
	n := 0
	for _, r := range results {
		if r == result {
			n++
		}
	}
	return n
}
