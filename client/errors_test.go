package client_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// registryStatus is the status the registry sends for reason, in domain.
func registryStatus(t *testing.T, reason idemregv1.ErrorReason, domain string) *status.Status {
	t.Helper()
	st, err := status.New(reason.Code(), "refused").WithDetails(&errdetails.ErrorInfo{Reason: reason.Reason(), Domain: domain})
	require.NoError(t, err)
	return st
}

// TestEveryRegistryReasonIsTyped: each reason of the API's ErrorReason, as
// the registry sends it (its string and its code), becomes a typed error
// matching exactly one sentinel, so that a reason added to the enum
// without a sentinel fails here. TOO_MANY_STREAMS is the exception: only
// health Watch and reflection streams get it, which the client never opens,
// so it has no sentinel and matches none.
func TestEveryRegistryReasonIsTyped(t *testing.T) {
	sentinels := []error{
		client.ErrInvalidArgument, client.ErrFingerprintMismatch, client.ErrLeaseLost, client.ErrAlreadyCompleted,
		client.ErrParked, client.ErrLeaseTotalExceeded, client.ErrQuotaExceeded, client.ErrNotFound,
		client.ErrUnavailable, client.ErrDeadlineExceeded, client.ErrCanceled, client.ErrInternal,
		client.ErrUnauthenticated, client.ErrPermissionDenied, client.ErrRateLimited, client.ErrInProgress,
		client.ErrMissingKey,
	}
	for n, name := range idemregv1.ErrorReason_name {
		r := idemregv1.ErrorReason(n)
		if r == idemregv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			continue
		}
		t.Run(name, func(t *testing.T) {
			err := client.FromStatus(registryStatus(t, r, client.ErrorDomain))
			var matched []error
			for _, s := range sentinels {
				if errors.Is(err, s) {
					matched = append(matched, s)
				}
			}
			want := 1
			if r == idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_STREAMS {
				want = 0
			}
			require.Len(t, matched, want, "%s matches %v", r.Reason(), matched)
			require.Equal(t, r.Code(), status.Code(err))
			var e *client.Error
			require.ErrorAs(t, err, &e)
			require.Equal(t, r.Reason(), e.Reason)
		})
	}
}

// TestErrorDomains: the registry sends ErrorDomain, a service name
// (AIP-193); this client still types the errors of a registry that sends
// the domain of before, "idemreg", for a release. Another service's
// domain is not the registry's, whatever its reason says.
func TestErrorDomains(t *testing.T) {
	require.Equal(t, "idemreg.dev", client.ErrorDomain)
	for _, tc := range []struct {
		name, domain string
		typed        bool
	}{
		{"idemreg.dev", "idemreg.dev", true},
		// Remove with legacyErrorDomain, in the release after the one
		// that first sends idemreg.dev.
		{"idemreg, before idemreg.dev", "idemreg", true},
		{"another service's", "payments.example", false},
		{"none", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := client.FromStatus(registryStatus(t, idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST, tc.domain))
			var e *client.Error
			require.ErrorAs(t, err, &e)
			if tc.typed {
				require.ErrorIs(t, err, client.ErrLeaseLost)
				require.Equal(t, client.ReasonLeaseLost, e.Reason)
				return
			}
			require.NotErrorIs(t, err, client.ErrLeaseLost)
			require.Empty(t, e.Reason)
		})
	}
}

// TestInterceptorsSendTheDomain: the statuses the interceptors answer with
// carry ErrorDomain, not the domain of before.
func TestInterceptorsSendTheDomain(t *testing.T) {
	for _, st := range []*status.Status{
		(&client.InProgressError{}).GRPCStatus(),
		(&client.ParkedError{}).GRPCStatus(),
	} {
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			if i, ok := d.(*errdetails.ErrorInfo); ok {
				info = i
			}
		}
		require.NotNil(t, info)
		require.Equal(t, "idemreg.dev", info.GetDomain())
	}
}
