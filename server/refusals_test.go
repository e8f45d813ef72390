package server_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
)

// fromSource dials addr from another loopback address, so that the
// server sees another source than the test's other connections.
func fromSource(ip string) grpc.DialOption {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", addr)
	})
}

// TestRefusalsHeldPerCaller (issue 35, weakness 8): a caller that draws
// refusals beyond its budget (RefusalRate 1 a second, burst 2) has each
// further refusal held for RefusalDelay (a minute here, so that a held
// call is plainly held), while its own accepted calls and every other
// caller's calls, refused or not, are answered at once. The budget is the
// identity's for an authenticated caller and the source address's for
// one without credentials; a caller holds at most
// MaxHeldRefusalsPerCaller, the next refusal being answered at once.
// Before, no refusal was ever held: a closed loop of them ran as fast as
// the server answered.
func TestRefusalsHeldPerCaller(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
  - {name: flood, token_hashes: ["`+access.HashToken("flood-token")+`"], consumers: ["flood.*"]}
`)
	reader := sdkmetric.NewManualReader()
	addr, _ := servertest.Serve(t, memStore(t), server.Config{Access: src, RefusalRate: 1, RefusalDelay: time.Minute,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	near := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr))
	far := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr, fromSource("127.0.0.2")))
	as := func(ctx context.Context, token string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "bearer "+token)
	}
	held := func() int64 { return collectSums(t, reader)[server.MetricRefusalsHeld] }
	// answered calls c, which must not be held: a held one would wait a
	// minute, and fails here instead.
	answered := func(ctx context.Context, c idemregv1.RegistryServiceClient, consumer string, want codes.Code) {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k-" + time.Now().String()})
		require.Equal(t, want, status.Code(err), "%v", err)
	}
	// heldCall starts a refused call that is to be held; cancel ends it.
	heldCall := func(ctx context.Context, c idemregv1.RegistryServiceClient, consumer string) (<-chan error, context.CancelFunc) {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Minute) // clamped to MaxRequestTimeout: held for half of it
		done := make(chan error, 1)
		go func() {
			_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
			done <- err
		}()
		return done, cancel
	}
	requireHeld := func(n int64) {
		t.Helper()
		require.Eventually(t, func() bool { return held() == n }, 20*time.Second, 5*time.Millisecond, "%d refusals held", n)
	}
	requireStillHeld := func(done <-chan error) {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("a refusal over the budget answered at once: %v", err)
		default:
		}
	}

	t.Run("identity", func(t *testing.T) {
		flood, team := as(t.Context(), "flood-token"), as(t.Context(), "team-token")
		answered(flood, near, "team.a", codes.PermissionDenied) // the burst
		answered(flood, near, "team.a", codes.PermissionDenied)
		done, cancel := heldCall(flood, near, "team.a")
		requireHeld(1)
		// Nothing else waits for it: flood's accepted calls, from any
		// address, and another identity's calls, refused or not.
		answered(flood, near, "flood.a", codes.OK)
		answered(flood, far, "flood.a", codes.OK)
		answered(team, near, "team.a", codes.OK)
		answered(team, near, "flood.a", codes.PermissionDenied)
		answered(team, far, "flood.a", codes.PermissionDenied)
		requireStillHeld(done)
		// The budget is the identity's, from every address.
		fromFar, cancelFar := heldCall(flood, far, "team.a")
		requireHeld(2)
		requireStillHeld(done)
		requireStillHeld(fromFar)
		cancel()
		cancelFar()
		require.Equal(t, codes.Canceled, status.Code(<-done))
		require.Equal(t, codes.Canceled, status.Code(<-fromFar))
		requireHeld(0)
	})

	t.Run("source", func(t *testing.T) {
		nobody := as(t.Context(), "wrong-token")
		answered(nobody, far, "team.a", codes.Unauthenticated)
		answered(nobody, far, "team.a", codes.Unauthenticated)
		done, cancel := heldCall(nobody, far, "team.a")
		requireHeld(1)
		// Another source without credentials has a budget of its own.
		answered(nobody, near, "team.a", codes.Unauthenticated)
		answered(nobody, near, "team.a", codes.Unauthenticated)
		answered(as(t.Context(), "team-token"), near, "team.a", codes.OK)
		requireStillHeld(done)
		cancel()
		require.Equal(t, codes.Canceled, status.Code(<-done))
		requireHeld(0)
	})

	t.Run("held slots are bounded", func(t *testing.T) {
		flood := as(t.Context(), "flood-token")
		ctx, cancel := context.WithTimeout(flood, 10*time.Minute)
		defer cancel()
		// Over as many connections as that takes: one takes
		// MaxConcurrentStreams (64) calls at once.
		over := server.MaxHeldRefusalsPerCaller + 8
		var conns []idemregv1.RegistryServiceClient
		for range over/60 + 1 {
			conns = append(conns, idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr)))
		}
		done := make(chan error, over)
		for i := range over {
			go func() {
				_, err := conns[i%len(conns)].Claim(ctx, &idemregv1.ClaimRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
				done <- err
			}()
		}
		requireHeld(server.MaxHeldRefusalsPerCaller)
		// The ones beyond the bound (and any within a refilled budget)
		// are answered, refused, at once.
		for range over - server.MaxHeldRefusalsPerCaller {
			require.Equal(t, codes.PermissionDenied, status.Code(<-done))
		}
		sums := collectSums(t, reader)
		require.Positive(t, sums[server.MetricRefusalsSlowed+" by=identity result=full"], "%v", sums)
		cancel()
		for range server.MaxHeldRefusalsPerCaller {
			<-done
		}
		requireHeld(0)
	})
}

// TestTooLargeRefusalHeld: a request a transcoder marked too large
// (server.MarkTooLarge: read or inflated up to the limit, which costs the
// server what hundreds of refusals cost) is refused INVALID_ARGUMENT,
// MALFORMED_REQUEST, with limit_bytes, and costs its caller's refusal
// budget 321 refusals (5 MiB at 16 KiB each): more than the default
// budget's burst (200), so it is held from the first, while another
// malformed request of the same caller, within its budget, is answered at
// once. Before, an authenticated tenant's gzip
// bombs within a budget counted in calls were never held: 4 callers took a
// neighbour to 6–12% of its throughput (make adversarial).
func TestTooLargeRefusalHeld(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
`)
	reader := sdkmetric.NewManualReader()
	addr, _ := servertest.Serve(t, memStore(t), server.Config{Access: src, RefusalRate: server.DefaultRefusalRate, RefusalDelay: time.Minute,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	c := idemregv1.NewRegistryServiceClient(servertest.Dial(t, addr))
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "bearer team-token")
	held := func() int64 { return collectSums(t, reader)[server.MetricRefusalsHeld] }

	malformed := &idemregv1.ClaimRequest{}
	server.MarkMalformed(malformed, "JSON: broken")
	_, err := c.Claim(ctx, malformed)
	st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	require.Empty(t, limitBytes(st))
	require.Zero(t, held(), "a refusal within the budget is answered at once")

	tooLarge := &idemregv1.ClaimRequest{}
	server.MarkTooLarge(tooLarge, 5<<20)
	callCtx, cancel := context.WithTimeout(ctx, 10*time.Minute) // held for half of MaxRequestTimeout at most
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := c.Claim(callCtx, tooLarge)
		done <- err
	}()
	require.Eventually(t, func() bool { return held() == 1 }, 20*time.Second, 5*time.Millisecond, "the too large request's refusal is held")
	select {
	case err := <-done:
		t.Fatalf("answered while held: %v", err)
	default:
	}
	cancel()
	<-done

	// Held for half its deadline, then answered: the limit is in its
	// ErrorInfo.
	shortCtx, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	_, err = c.Claim(shortCtx, tooLarge)
	st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)
	require.Equal(t, "5242880", limitBytes(st))
}

// limitBytes is the limit_bytes of st's ErrorInfo.
func limitBytes(st *status.Status) string {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetMetadata()["limit_bytes"]
		}
	}
	return ""
}
