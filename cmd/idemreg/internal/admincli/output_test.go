package admincli_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/admincli"
)

// TestCallErrorText: a refusal reads as one line of message, code, reason
// and metadata (sorted), then a line for each detail a person acts on.
// The server's own refusals are run in cmd/idemreg's TestAdminOutput; a
// store that is down, whose RetryInfo this shows, is not easily had there.
func TestCallErrorText(t *testing.T) {
	st, err := status.New(codes.Unavailable, "the store is unavailable").WithDetails(
		&errdetails.ErrorInfo{Reason: "STORE_UNAVAILABLE", Domain: "idemreg.dev", Metadata: map[string]string{"kind": "operation", "consumer": "billing.worker"}},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(2 * time.Second)},
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "key", Description: "required"}}},
	)
	require.NoError(t, err)
	require.Equal(t, "error: the store is unavailable (UNAVAILABLE, reason STORE_UNAVAILABLE, consumer=billing.worker, kind=operation)\n"+
		"  retry after 2s\n"+
		"  field key: required", (&admincli.CallError{Err: st.Err()}).Error())
	require.Equal(t, "error: permission denied (PERMISSION_DENIED)",
		(&admincli.CallError{Err: status.Error(codes.PermissionDenied, "permission denied")}).Error())
}
