package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/claimsecret"
	"github.com/idemreg/idemreg/server/internal/quota"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/internal/storechain"
	"github.com/idemreg/idemreg/storage"
)

// TestClassify: each error the service meets has one reason, and the
// status, the store's metrics, readiness and the admin audit all say it.
// The errors are those the stores and the server return, wrapped as they
// wrap them.
func TestClassify(t *testing.T) {
	ended, cancel := context.WithCancel(t.Context())
	cancel()
	for _, tc := range []struct {
		name      string
		err       error
		reason    idemregv1.ErrorReason
		errorType string // idemreg.store.errors; "" for an answer
		readiness string // "ok", "failed" or "" (not counted)
	}{
		{"fingerprint mismatch", storage.ErrFingerprintMismatch, idemregv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH, "", "ok"},
		{"lease lost", fmt.Errorf("postgres complete: %w", storage.ErrLeaseLost), idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST, "", "ok"},
		{"claim secret invalid", claimsecret.ErrUnknown, idemregv1.ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID, "", "ok"},
		{"already completed", storage.ErrAlreadyCompleted, idemregv1.ErrorReason_ERROR_REASON_ALREADY_COMPLETED, "", "ok"},
		{"parked", storage.ErrParked, idemregv1.ErrorReason_ERROR_REASON_PARKED, "", "ok"},
		{"lease total exceeded", storage.ErrLeaseTotalExceeded, idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED, "", "ok"},
		{"lease total exceeded, with its bound", &leaseTotalExceeded{}, idemregv1.ErrorReason_ERROR_REASON_LEASE_TOTAL_EXCEEDED, "", "ok"},
		{"quota exceeded", &quota.Exceeded{Consumer: "c", MaxRecords: 1, Records: 1}, idemregv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED, "", "ok"},
		{"not found", fmt.Errorf("pebble lookup: %w", storage.ErrNotFound), idemregv1.ErrorReason_ERROR_REASON_NOT_FOUND, "", "ok"},
		{"store unavailable", fmt.Errorf("%w: postgres claim: %w", storage.ErrUnavailable, errors.New("SQLSTATE 53100")), idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "unavailable", "failed"},
		{"deadline", fmt.Errorf("postgres claim: %w", context.DeadlineExceeded), idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED, "deadline", ""},
		{"deadline mid-statement", fmt.Errorf("%w: %w", storage.ErrUnavailable, context.DeadlineExceeded), idemregv1.ErrorReason_ERROR_REASON_DEADLINE_EXCEEDED, "deadline", ""},
		{"cancelled", fmt.Errorf("%w: %w", context.Canceled, storage.ErrUnavailable), idemregv1.ErrorReason_ERROR_REASON_CANCELED, "canceled", ""},
		{"overloaded", storechain.ErrOverloaded, idemregv1.ErrorReason_ERROR_REASON_OVERLOADED, "internal", ""},
		{"an identity's share", &storechain.ShareExceeded{Identity: "billing", Share: 2}, idemregv1.ErrorReason_ERROR_REASON_OVERLOADED, "internal", ""},
		{"disk below the reserve", fmt.Errorf("pebble claim: %w", &storage.ExhaustedError{Resource: storage.ResourceDisk}), idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED, "exhausted", ""},
		{"database disk full", &storage.ExhaustedError{Resource: storage.ResourceDisk, Err: errors.New("SQLSTATE 53100")}, idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED, "exhausted", ""},
		{"too many connections", &storage.ExhaustedError{Resource: storage.ResourceConnections}, idemregv1.ErrorReason_ERROR_REASON_CAPACITY_EXHAUSTED, "exhausted", ""},
		{"store failed for good", fmt.Errorf("%w: pebble: %w", storage.ErrUnavailable, storage.ErrFailed), idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "unavailable", "failed"},
		{"anything else", errors.New("decoding stored result"), idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := reason.Classify(tc.err)
			require.Equal(t, tc.reason, got)

			errorType := ""
			if !reason.IsAnswer(got) {
				errorType = storechain.ErrorType(got)
			}
			require.Equal(t, tc.errorType, errorType, "the store's error.type")

			var c callOutcomes
			c.record(tc.err)
			readiness := map[[2]int64]string{{1, 0}: "ok", {0, 1}: "failed", {0, 0}: ""}[[2]int64{c.ok.Load(), c.failed.Load()}]
			require.Equal(t, tc.readiness, readiness, "readiness")

			// The request has ended: its answer is the error's reason.
			require.Equal(t, got, reason.Answer(ended, tc.err))
			svc := &Service{statuses: statuses{logger: slog.New(slog.DiscardHandler)}}
			st := status.Convert(svc.toStatus(ended, "Claim", storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}, tc.err))
			require.Equal(t, got.Code(), st.Code())
			info, ok := st.Details()[0].(*errdetails.ErrorInfo)
			require.True(t, ok)
			require.Equal(t, got.Reason(), info.GetReason())
			require.Equal(t, "idemreg.dev", info.GetDomain(), "a service name (AIP-193)")
		})
	}
}

// TestAnswerReasonOfARunningRequest: a deadline that ran out while the
// request still runs was the store's share of its time: the caller is
// told STORE_UNAVAILABLE; every other reason is classify's.
func TestAnswerReasonOfARunningRequest(t *testing.T) {
	running := t.Context()
	require.Equal(t, idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, reason.Answer(running, fmt.Errorf("postgres claim: %w", context.DeadlineExceeded)))
	require.Equal(t, idemregv1.ErrorReason_ERROR_REASON_CANCELED, reason.Answer(running, context.Canceled))
	require.Equal(t, idemregv1.ErrorReason_ERROR_REASON_LEASE_LOST, reason.Answer(running, storage.ErrLeaseLost))
	require.Equal(t, idemregv1.ErrorReason_ERROR_REASON_UNSPECIFIED, reason.Answer(running, nil))
}

// TestCapacityExhaustedStatus: a short resource is RESOURCE_EXHAUSTED,
// CAPACITY_EXHAUSTED naming the resource, with a RetryInfo that says
// retrying at once does not help (connections free up sooner than
// disks); a store that failed for good is UNAVAILABLE with RetryInfo.
func TestCapacityExhaustedStatus(t *testing.T) {
	svc := &Service{statuses: statuses{logger: slog.New(slog.DiscardHandler)}}
	for _, tc := range []struct {
		name     string
		err      error
		code     codes.Code
		resource string
		retry    time.Duration
	}{
		{"disk", &storage.ExhaustedError{Resource: storage.ResourceDisk}, codes.ResourceExhausted, "disk", exhaustedRetryAfter},
		{"memory", &storage.ExhaustedError{Resource: storage.ResourceMemory}, codes.ResourceExhausted, "memory", exhaustedRetryAfter},
		{"connections", &storage.ExhaustedError{Resource: storage.ResourceConnections}, codes.ResourceExhausted, "connections", connectionsRetryAfter},
		{"file descriptors", &storage.ExhaustedError{Resource: storage.ResourceFileDescriptors}, codes.ResourceExhausted, "file_descriptors", exhaustedRetryAfter},
		{"failed", fmt.Errorf("%w: %w", storage.ErrUnavailable, storage.ErrFailed), codes.Unavailable, "", unavailableRetryAfter},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := status.Convert(svc.toStatus(t.Context(), "Claim", storage.Key{Consumer: "c", Kind: storage.KindMessage, Key: "k"}, tc.err))
			require.Equal(t, tc.code, st.Code())
			var retry time.Duration
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.ErrorInfo:
					require.Equal(t, tc.resource, d.GetMetadata()["resource"])
				case *errdetails.RetryInfo:
					retry = d.GetRetryDelay().AsDuration()
				}
			}
			require.Equal(t, tc.retry, retry)
		})
	}
}
