package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
)

// silentStore never answers: every call waits for its context, the way a
// statement on a connection that went silent waits (a black-holed network
// between the service and its database). Ping answers, so health does not
// get in the way. Claims of other keys than m-1 reach the store it wraps,
// so that a test can hold a claim to Complete.
type silentStore struct{ storage.Store }

func (silentStore) wait(ctx context.Context, op string) error {
	<-ctx.Done()
	return fmt.Errorf("postgres %s: %w", op, ctx.Err())
}

func (s silentStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	if p.Key.Key != "m-1" {
		return s.Store.Claim(ctx, p)
	}
	return storage.ClaimResult{}, s.wait(ctx, "claim")
}

func (s silentStore) Complete(ctx context.Context, _ storage.CompleteParams) (storage.Record, error) {
	return storage.Record{}, s.wait(ctx, "complete")
}

func (s silentStore) Lookup(ctx context.Context, _ storage.Key) (storage.Record, error) {
	return storage.Record{}, s.wait(ctx, "lookup")
}

func (silentStore) Ping(context.Context) error { return nil }

// TestSilentStoreAnswersUnavailableBeforeTheDeadline: when the store does
// not answer, the client gets UNAVAILABLE (STORE_UNAVAILABLE, with
// RetryInfo) before its deadline, not DEADLINE_EXCEEDED at it; a call
// without a deadline gets the same within the server's request budget.
func TestSilentStoreAnswersUnavailableBeforeTheDeadline(t *testing.T) {
	// Deadlines are long enough that the server's margin (a tenth of the
	// time left) outlasts scheduling delays on a loaded machine; the
	// subtests run in parallel so the test still takes one deadline.
	conn := start(t, silentStore{memStore(t)}, server.Config{RequestTimeout: 5 * time.Second})
	c := idemregv1.NewRegistryServiceClient(conn)
	k := func() (string, idemregv1.Kind, string) { return "silent.test", idemregv1.Kind_KIND_MESSAGE, "m-1" }

	for _, tc := range []struct {
		name     string
		deadline time.Duration // 0: none, the server's budget applies
		call     func(ctx context.Context) error
	}{
		{"Claim", 5 * time.Second, func(ctx context.Context) error {
			consumer, kind, key := k()
			_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: key})
			return err
		}},
		{"Complete", 4 * time.Second, func(ctx context.Context) error {
			consumer, kind, _ := k()
			cl, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: "c-1"})
			if err != nil {
				return err
			}
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: "c-1", Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(),
				Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "t"}}}})
			return err
		}},
		{"Lookup without a deadline", 0, func(ctx context.Context) error {
			consumer, kind, key := k()
			_, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: key})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			if tc.deadline > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.deadline)
				defer cancel()
			}
			// UNAVAILABLE itself says the server answered before the
			// client's deadline: at the deadline the client would see
			// DEADLINE_EXCEEDED.
			st := status.Convert(tc.call(ctx))
			require.Equal(t, codes.Unavailable, st.Code(), "%v", st.Err())
			var reason string
			var retry bool
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.ErrorInfo:
					reason = d.GetReason()
				case *errdetails.RetryInfo:
					retry = true
				}
			}
			require.Equal(t, idemregv1.ReasonStoreUnavailable, reason)
			require.True(t, retry, "RetryInfo")
		})
	}

	// A caller that gives up still gets CANCELED.
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(100*time.Millisecond, cancel)
	consumer, kind, key := k()
	_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: kind, Key: key})
	require.Equal(t, codes.Canceled, status.Code(err))
}
