package storagetest

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

// The Store area: the cases of storage.Store's own methods, one file per
// operation (claim.go, complete.go, lease.go, records.go, park.go) and the
// races between them (race.go). Cases use keys of their own, so stores may
// be shared.

const (
	lease     = 10 * time.Second
	retention = time.Hour
)

func storeCases() []testCase[storage.Store] {
	return withoutStore(slices.Concat([]capabilityCase[storage.Store]{
		{"ClaimNewKey", testClaimNewKey},
		{"ClaimInProgress", testClaimInProgress},
		{"ClaimInProgressFingerprintMismatch", testClaimInProgressMismatch},
		{"ClaimTakeover", testClaimTakeover},
		{"ClaimTakeoverFingerprintMismatch", testClaimTakeoverMismatch},
		{"ClaimTakeoverKeepsFingerprint", testClaimTakeoverKeepsFingerprint},
		{"ClaimCompletedReplay", testClaimCompletedReplay},
		{"ClaimCompletedFingerprintMismatch", testClaimCompletedMismatch},
		{"ClaimExpiredCompleted", testClaimExpiredCompleted},
		{"ClaimExpiredInProgress", testClaimExpiredInProgress},
		{"ClaimRepeatedRequestID", testClaimRepeatedRequestID},
		{"ClaimRequestIDAfterLease", testClaimRequestIDAfterLease},
		{"ExpiryBoundary", testExpiryBoundary},
		{"ScopesAreIndependent", testScopes},
		{"Complete", testComplete},
		{"CompleteRepeated", testCompleteRepeated},
		{"CompleteAfterLeaseExpiredWithoutTakeover", testCompleteAfterLeaseExpired},
		{"CompleteStaleToken", testCompleteStale},
		{"CompleteNotFound", testCompleteNotFound},
		{"Release", testRelease},
		{"ReleaseErrors", testReleaseErrors},
		{"Extend", testExtend},
		{"ExtendKeepsTheLease", testExtendKeepsTheLease},
		{"ExtendErrors", testExtendErrors},
		{"ExtendLeaseTotal", testExtendLeaseTotal},
		{"LookupNotFound", testLookupNotFound},
		{"TokensIncrease", testTokensIncrease},
		{"LargeResult", testLargeResult},
		{"RaceClaimNewKey", testRaceClaimNewKey},
		{"RaceTakeover", testRaceTakeover},
		{"RaceCompleteVersusTakeover", testRaceCompleteVersusTakeover},
		{"RaceFencedOperations", testRaceFenced},
		{"RaceManyKeys", testRaceManyKeys},
		{"RaceRepeatedRequestID", testRaceRepeatedRequestID},
	}, parkCases))
}

var keySeq atomic.Int64

// newKey returns a key no other case uses, so stores may be shared.
func newKey(kind storage.Kind) storage.Key {
	n := keySeq.Add(1)
	return storage.Key{Consumer: "suite.consumer", Kind: kind, Key: fmt.Sprintf("key-%d-%d", time.Now().UnixNano(), n)}
}

func claimParams(k storage.Key, fp string) storage.ClaimParams {
	return storage.ClaimParams{Key: k, Fingerprint: []byte(fp), Lease: lease, Retention: retention, Holder: "holder-a"}
}

func acquire(t *testing.T, s storage.Store, p storage.ClaimParams) storage.Record {
	t.Helper()
	res, err := s.Claim(t.Context(), p)
	require.NoError(t, err)
	require.Equal(t, storage.OutcomeAcquired, res.Outcome)
	return res.Record
}

func complete(t *testing.T, s storage.Store, k storage.Key, token int64, result string) storage.Record {
	t.Helper()
	rec, err := s.Complete(t.Context(), storage.CompleteParams{Key: k, Token: token, Result: []byte(result)})
	require.NoError(t, err)
	return rec
}

// requireSame checks that two reads of a record agree on every field.
func requireSame(t *testing.T, want, got storage.Record) {
	t.Helper()
	require.Equal(t, want.Key, got.Key)
	require.Equal(t, want.State, got.State)
	require.Equal(t, string(want.Fingerprint), string(got.Fingerprint))
	require.Equal(t, want.Token, got.Token)
	require.Equal(t, want.Attempt, got.Attempt)
	require.Equal(t, want.Holder, got.Holder)
	require.Equal(t, want.RequestID, got.RequestID)
	require.Equal(t, want.Lease, got.Lease)
	require.True(t, want.CreatedAt.Equal(got.CreatedAt), "created_at %v != %v", want.CreatedAt, got.CreatedAt)
	require.True(t, want.LeaseExpiresAt.Equal(got.LeaseExpiresAt), "lease_expires_at %v != %v", want.LeaseExpiresAt, got.LeaseExpiresAt)
	require.True(t, want.CompletedAt.Equal(got.CompletedAt), "completed_at %v != %v", want.CompletedAt, got.CompletedAt)
	require.True(t, want.ExpiresAt.Equal(got.ExpiresAt), "expires_at %v != %v", want.ExpiresAt, got.ExpiresAt)
	require.Equal(t, want.Retention, got.Retention)
	require.Equal(t, string(want.Result), string(got.Result))
	require.Equal(t, want.ParkReason, got.ParkReason)
}
