package server_test

import (
	"context"
	"fmt"
	"strings"
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
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
)

// TestHostileRequests sends malformed and hostile requests over the wire:
// each is INVALID_ARGUMENT naming exactly the bad fields, nothing is
// stored, and the server goes on serving.
func TestHostileRequests(t *testing.T) {
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{}))
	ctx := t.Context()
	const consumer = "hostile.test"
	op := idemregv1.Kind_KIND_OPERATION
	claim := func(mut func(r *idemregv1.ClaimRequest)) func() error {
		return func() error {
			r := &idemregv1.ClaimRequest{Consumer: consumer, Kind: op, Key: "k"}
			mut(r)
			_, err := c.Claim(ctx, r)
			return err
		}
	}
	complete := func(res *idemregv1.Result) func() error {
		return func() error {
			_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: op, Key: "k", Token: 1, ClaimSecret: forged, Result: res})
			return err
		}
	}
	failure := func(code int32, msg string) *idemregv1.Result {
		return &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: code, Message: msg}}}
	}
	cases := []struct {
		name   string
		call   func() error
		fields []string
	}{
		{"key of 257 bytes", claim(func(r *idemregv1.ClaimRequest) { r.Key = strings.Repeat("k", 257) }), []string{"key"}},
		{"key of 1 MiB", claim(func(r *idemregv1.ClaimRequest) { r.Key = strings.Repeat("k", 1<<20) }), []string{"key"}},
		{"consumer of 129 bytes", claim(func(r *idemregv1.ClaimRequest) { r.Consumer = strings.Repeat("c", 129) }), []string{"consumer"}},
		{"fingerprint of 65 bytes", claim(func(r *idemregv1.ClaimRequest) { r.Fingerprint = make([]byte, 65) }), []string{"fingerprint"}},
		{"holder of 129 bytes", claim(func(r *idemregv1.ClaimRequest) { r.Holder = strings.Repeat("h", 129) }), []string{"holder"}},
		{"invalid UTF-8 everywhere", claim(func(r *idemregv1.ClaimRequest) {
			r.Consumer, r.Key, r.Holder = "c\xff", "k\xc3\x28", "h\xed\xa0\x80" // a surrogate half
		}), []string{"consumer", "holder", "key"}},
		{"control characters and a non-ASCII space in the key", claim(func(r *idemregv1.ClaimRequest) { r.Key = "a\x00b\u00a0" }), []string{"key"}},
		{"a NUL byte in the holder (PostgreSQL refuses it in text)", claim(func(r *idemregv1.ClaimRequest) { r.Holder = "h\x00" }), []string{"holder"}},
		{"a newline in the holder", claim(func(r *idemregv1.ClaimRequest) { r.Holder = "h\nlevel=ERROR" }), []string{"holder"}},
		{"a format character in the key", claim(func(r *idemregv1.ClaimRequest) { r.Key = "a\u200bb" }), []string{"key"}},
		{"zero lease", claim(func(r *idemregv1.ClaimRequest) { r.Lease = &durationpb.Duration{} }), []string{"lease"}},
		{"negative lease and retention", claim(func(r *idemregv1.ClaimRequest) {
			r.Lease, r.Retention = durationpb.New(-time.Second), durationpb.New(-time.Hour)
		}), []string{"lease", "retention"}},
		{"zero retention", claim(func(r *idemregv1.ClaimRequest) { r.Retention = &durationpb.Duration{} }), []string{"retention"}},
		{"malformed durations", claim(func(r *idemregv1.ClaimRequest) {
			r.Lease = &durationpb.Duration{Seconds: 5, Nanos: -1}               // signs disagree
			r.Retention = &durationpb.Duration{Seconds: 315576000001, Nanos: 0} // beyond ±10000 years
		}), []string{"lease", "retention"}},
		{"huge lease", claim(func(r *idemregv1.ClaimRequest) { r.Lease = &durationpb.Duration{Seconds: 1 << 40} }), []string{"lease"}},
		{"unknown kind", claim(func(r *idemregv1.ClaimRequest) { r.Kind = idemregv1.Kind(99) }), []string{"kind"}},
		{"negative kind", claim(func(r *idemregv1.ClaimRequest) { r.Kind = idemregv1.Kind(-1) }), []string{"kind"}},
		{"unspecified kind", claim(func(r *idemregv1.ClaimRequest) { r.Kind = idemregv1.Kind_KIND_UNSPECIFIED }), []string{"kind"}},
		{"result over 1 MiB", complete(&idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{
			Type: "t", Data: make([]byte, server.DefaultMaxResultBytes)}}}), []string{"result"}},
		{"failure code OK", complete(failure(0, "ok?")), []string{"result.failure.code"}},
		{"failure code 17", complete(failure(17, "")), []string{"result.failure.code"}},
		{"negative failure code", complete(failure(-2, "")), []string{"result.failure.code"}},
		{"failure message not UTF-8", complete(failure(9, "\xff")), []string{"result.failure.message"}},
		{"response type not UTF-8", complete(&idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "\xc0\xaf"}}}),
			[]string{"result.response.type"}},
		{"empty result", complete(&idemregv1.Result{}), []string{"result"}},
		// Stored text (docs/operations.md, threat model): no NUL, which
		// PostgreSQL refuses in text, and no control character.
		{"a NUL in the failure message", complete(failure(9, "declined\x00")), []string{"result.failure.message"}},
		{"a newline in the failure message", complete(failure(9, "declined\nlevel=ERROR")), []string{"result.failure.message"}},
		{"an escape sequence in the failure message", complete(failure(9, "\x1b[2J")), []string{"result.failure.message"}},
		{"a NUL in the response type", complete(&idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "payments.v1.Charge\x00"}}}),
			[]string{"result.response.type"}},
		{"a tab in the response type", complete(&idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "payments\tv1"}}}),
			[]string{"result.response.type"}},
		{"zero and negative tokens", func() error {
			for _, tok := range []int64{0, -1, -1 << 63} {
				if _, err := c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: op, Key: "k", Token: tok, ClaimSecret: forged}); status.Code(err) != codes.InvalidArgument {
					return fmt.Errorf("token %d: %v", tok, err)
				}
			}
			_, err := c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: op, Key: "k", Token: -5, ClaimSecret: forged, Lease: durationpb.New(0)})
			return err
		}, []string{"lease", "token"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := requireStatus(t, tc.call(), codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.ElementsMatch(t, tc.fields, violatedFields(st))
			require.Less(t, len(st.Message()), 1024, "the message does not echo a huge field")
		})
	}
	_, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: op, Key: "k"})
	require.Equal(t, codes.NotFound, status.Code(err), "nothing was stored")
}

// TestHostileMessages sends requests the protobuf layer sees before
// validation: unknown fields are ignored, a message over the size limit is
// refused by gRPC, an undecodable one is INVALID_ARGUMENT (the server's
// codec, TestMalformedRequests), and the server stays up.
func TestHostileMessages(t *testing.T) {
	conn := start(t, memStore(t), server.Config{})
	c := idemregv1.NewRegistryServiceClient(conn)
	ctx := t.Context()

	req := &idemregv1.ClaimRequest{Consumer: "hostile.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "unknown-fields"}
	req.ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 999, protowire.BytesType), []byte("surprise")))
	res, err := c.Claim(ctx, req)
	require.NoError(t, err, "unknown fields are ignored")
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())

	big := &idemregv1.CompleteRequest{Consumer: "hostile.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k", Token: 1, ClaimSecret: forged,
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "t", Data: make([]byte, 6<<20)}}}}
	_, err = c.Complete(ctx, big)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "over the server's maximum message size: %v", err)

	// A truncated field: length 100, two bytes follow.
	broken := &idemregv1.LookupRequest{}
	broken.ProtoReflect().SetUnknown([]byte{0x1a, 100, 'a', 'b'})
	_, err = c.Lookup(ctx, broken)
	requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonMalformedRequest)

	_, err = c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: "hostile.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "after"})
	require.NoError(t, err, "still serving")
}

// TestDeadlineAlreadyPast: a request whose deadline has passed is not
// executed; the answer is DEADLINE_EXCEEDED. gRPC's client does not send
// one whose deadline passed before the call, so the server's side is
// checked on the service itself, as when the deadline runs out in transit.
func TestDeadlineAlreadyPast(t *testing.T) {
	store := memStore(t)
	c := idemregv1.NewRegistryServiceClient(start(t, store, server.Config{}))
	req := &idemregv1.ClaimRequest{Consumer: "hostile.test", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "late"}

	ctx, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	_, err := c.Claim(ctx, req)
	require.Equal(t, codes.DeadlineExceeded, status.Code(err))

	svc, err := server.NewService(store, server.DefaultLimits(), nil)
	require.NoError(t, err)
	_, err = svc.Claim(ctx, req)
	requireStatus(t, err, codes.DeadlineExceeded, idemregv1.ReasonDeadlineExceeded)
	_, err = svc.Complete(ctx, &idemregv1.CompleteRequest{Consumer: req.Consumer, Kind: req.Kind, Key: req.Key, Token: 1, ClaimSecret: forged, Result: response("r")})
	requireStatus(t, err, codes.DeadlineExceeded, idemregv1.ReasonDeadlineExceeded)

	_, err = c.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: req.Consumer, Kind: req.Kind, Key: req.Key})
	require.Equal(t, codes.NotFound, status.Code(err), "an expired request claimed nothing")
}

// exitStore reports how each gated Claim ended.
type exitStore struct {
	*gateStore
	exited chan error
}

func (s exitStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	res, err := s.gateStore.Claim(ctx, p)
	s.exited <- err
	return res, err
}

// TestClientDisconnectsMidCall closes the client's connection while its
// Claim waits in the store: the store call sees its context end, nothing
// is stored, and other clients are served as before.
func TestClientDisconnectsMidCall(t *testing.T) {
	g := exitStore{gateStore: &gateStore{Store: memStore(t), entered: make(chan struct{}, 1), gate: make(chan struct{})}, exited: make(chan error, 2)}
	addr, _ := serve(t, g, server.Config{})
	gone, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	result := make(chan error, 1)
	go func() {
		_, err := idemregv1.NewRegistryServiceClient(gone).Claim(t.Context(), claimReq("mid-call", ""))
		result <- err
	}()
	<-g.entered
	require.NoError(t, gone.Close())
	require.Equal(t, codes.Canceled, status.Code(<-result))
	require.ErrorIs(t, <-g.exited, context.Canceled, "the store call saw the disconnect")

	close(g.gate)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	res, err := idemregv1.NewRegistryServiceClient(conn).Claim(t.Context(), claimReq("mid-call", ""))
	require.NoError(t, err)
	require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome(), "the abandoned Claim stored nothing")
}

// TestThousandConnections opens a thousand client connections at once,
// each making a Claim and a Lookup of its own key. The server's admission
// control may refuse some calls with UNAVAILABLE and a RetryInfo
// (OVERLOADED); those are retried after the delay it asks for, as a client
// would, and every call must get through.
func TestThousandConnections(t *testing.T) {
	const n = 1000
	addr, _ := serve(t, memStore(t), server.Config{})
	var (
		wg         sync.WaitGroup
		errs       = make(chan error, n)
		overloaded atomic.Int64
	)
	// retry makes call until it is not refused for overload.
	retry := func(ctx context.Context, call func() error) error {
		for {
			err := call()
			info := retryDelay(err)
			if status.Code(err) != codes.Unavailable || info <= 0 {
				return err
			}
			overloaded.Add(1)
			select {
			case <-ctx.Done():
				return err
			case <-time.After(info):
			}
		}
	}
	for i := range n {
		wg.Go(func() {
			// Beyond MaxConnections a connection waits in the accept queue
			// until another closes; on a loaded machine that can outlast
			// the client's handshake timeout, and the client then dials
			// again: its calls wait for that (WaitForReady) rather than fail.
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close()
			c := idemregv1.NewRegistryServiceClient(conn)
			ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
			defer cancel()
			key := fmt.Sprintf("conn-%d", i)
			if err := retry(ctx, func() error { _, err := c.Claim(ctx, claimReq(key, "")); return err }); err != nil {
				errs <- fmt.Errorf("claim %s: %w", key, err)
				return
			}
			var got *idemregv1.LookupResponse
			err = retry(ctx, func() (err error) {
				got, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: "billing.payment-worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
				return err
			})
			if err != nil || got.GetRecord().GetKey() != key {
				errs <- fmt.Errorf("lookup %s: %v", key, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d calls refused for overload and retried", overloaded.Load())
}

// retryDelay is the RetryInfo delay of err, or 0.
func retryDelay(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			return r.GetRetryDelay().AsDuration()
		}
	}
	return 0
}

var _ storage.Store = (*gateStore)(nil)
