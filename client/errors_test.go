package client_test

import (
	"errors"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// registryStatus is the status the registry sends for reason, in domain.
func registryStatus(t *testing.T, reason idemregv1.ErrorReason, domain string) *status.Status {
	t.Helper()
	st, err := status.New(reason.Code(), "refused").WithDetails(&errdetails.ErrorInfo{Reason: reason.Reason(), Domain: domain})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestEveryRegistryReasonIsTyped: each reason of the API's ErrorReason, as
// the registry sends it (its string and its code), becomes a typed error
// matching exactly one sentinel, so that a reason added to the enum
// without a sentinel fails here. TOO_MANY_STREAMS and BACKUP_UNSUPPORTED
// are the exceptions: only health Watch and reflection streams get the
// first, and only AdminService's backup calls the second, neither of which
// the client makes, so they have no sentinel and match none.
func TestEveryRegistryReasonIsTyped(t *testing.T) {
	sentinels := []error{
		client.ErrInvalidArgument, client.ErrFingerprintMismatch, client.ErrLeaseLost, client.ErrClaimSecretInvalid, client.ErrAlreadyCompleted,
		client.ErrParked, client.ErrLeaseTotalExceeded, client.ErrQuotaExceeded, client.ErrNotFound,
		client.ErrUnavailable, client.ErrDeadlineExceeded, client.ErrCanceled, client.ErrInternal,
		client.ErrUnauthenticated, client.ErrPermissionDenied, client.ErrRateLimited, client.ErrInProgress,
		client.ErrMissingKey, client.ErrCapacityExhausted,
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
			if r == idemregv1.ErrorReason_ERROR_REASON_TOO_MANY_STREAMS || r == idemregv1.ErrorReason_ERROR_REASON_BACKUP_UNSUPPORTED {
				want = 0
			}
			if len(matched) != want {
				t.Fatalf("%s matches %v, want %d sentinel(s)", r.Reason(), matched, want)
			}
			if got := status.Code(err); got != r.Code() {
				t.Fatalf("code %v, want %v", got, r.Code())
			}
			var e *client.Error
			if !errors.As(err, &e) {
				t.Fatalf("%v is not a *client.Error", err)
			}
			if e.Reason != r.Reason() {
				t.Fatalf("reason %q, want %q", e.Reason, r.Reason())
			}
		})
	}
}

// TestErrorDomains: the registry sends ErrorDomain, a service name
// (AIP-193); this client still types the errors of a registry that sends
// the domain of before, "idemreg", for a release. Another service's
// domain is not the registry's, whatever its reason says.
func TestErrorDomains(t *testing.T) {
	if client.ErrorDomain != "idemreg.dev" {
		t.Fatalf("ErrorDomain %q, want idemreg.dev", client.ErrorDomain)
	}
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
			if !errors.As(err, &e) {
				t.Fatalf("%v is not a *client.Error", err)
			}
			if tc.typed {
				if !errors.Is(err, client.ErrLeaseLost) || e.Reason != client.ReasonLeaseLost {
					t.Fatalf("%v (reason %q): want ErrLeaseLost", err, e.Reason)
				}
				return
			}
			if errors.Is(err, client.ErrLeaseLost) || e.Reason != "" {
				t.Fatalf("%v (reason %q): another domain's error must not be typed", err, e.Reason)
			}
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
		if info.GetDomain() != "idemreg.dev" {
			t.Fatalf("ErrorInfo %v: want domain idemreg.dev", info)
		}
	}
}
