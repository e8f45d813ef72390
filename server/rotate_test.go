package server_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// lockedBuffer collects a server's log lines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// replica is one server of a rotation test.
type replica struct {
	reg   idemregv1.RegistryServiceClient
	admin idemregv1.AdminServiceClient
	logs  *lockedBuffer
}

func startReplica(t *testing.T, store storage.Store, clock *storagetest.Clock, refresh time.Duration) replica {
	t.Helper()
	logs := &lockedBuffer{}
	conn := start(t, store, server.Config{Now: clock.Now, ClaimKeyRefresh: refresh,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	return replica{reg: idemregv1.NewRegistryServiceClient(conn), admin: idemregv1.NewAdminServiceClient(conn), logs: logs}
}

// TestClaimKeyRotationAcrossReplicas (issue 25, finding 6): two replicas on
// one PostgreSQL database; the claim key is rotated while a claim is held
// through A. B, which is not restarted and whose own refresh is not due,
// completes A's claim with the secret A gave (the old generation, within
// its grace), and a claim acquired after the rotation under the new
// generation; page tokens of either replica open on the other, across
// the rotation; after the grace the old secret and page token are refused,
// with CLAIM_SECRET_INVALID (not LEASE_LOST) and a WARN naming the
// generations.
func TestClaimKeyRotationAcrossReplicas(t *testing.T) {
	clock := &storagetest.Clock{}
	db := pgtest.NewDatabase(t)
	open := func() *postgres.Store {
		s, err := postgres.Open(t.Context(), db, postgres.WithClockOffset(clock.Offset))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	a := startReplica(t, open(), clock, time.Minute)
	b := startReplica(t, open(), clock, 6*time.Hour) // learns of the rotation only by a miss
	testRotation(t, clock, a, b, open())
}

// TestClaimKeyRotationEmbedded is the same on the embedded store, one
// replica, the rotation made on the open store (the data directory is
// locked while serve runs).
func TestClaimKeyRotationEmbedded(t *testing.T) {
	clock := &storagetest.Clock{}
	s, err := pebble.Open(t.TempDir(), pebble.WithClock(clock.Now))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	r := startReplica(t, s, clock, time.Minute)
	testRotation(t, clock, r, r, s)
}

func testRotation(t *testing.T, clock *storagetest.Clock, a, b replica, rotator storage.ClaimKeys) {
	ctx := t.Context()
	const consumer = "billing.payment-worker"
	claim := func(r replica, key string) *idemregv1.ClaimResponse {
		t.Helper()
		req := claimReq(key, "fp")
		req.Lease = durationpb.New(30 * time.Minute)
		res, err := r.reg.Claim(ctx, req)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
		return res
	}
	complete := func(r replica, key string, cl *idemregv1.ClaimResponse) error {
		_, err := r.reg.Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
			Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response("done " + key)})
		return err
	}
	extend := func(r replica, key string, cl *idemregv1.ClaimResponse) error {
		_, err := r.reg.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
			Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Lease: durationpb.New(30 * time.Minute)})
		return err
	}
	list := func(r replica, token string) (*idemregv1.ListRecordsResponse, error) {
		return r.admin.ListRecords(ctx, &idemregv1.ListRecordsRequest{Consumer: consumer, State: idemregv1.State_STATE_IN_PROGRESS, PageSize: 1, PageToken: token})
	}
	pageToken := func(r replica) string {
		t.Helper()
		res, err := list(r, "")
		require.NoError(t, err)
		require.NotEmpty(t, res.GetNextPageToken())
		return res.GetNextPageToken()
	}

	// Before the rotation: both replicas have read generation 1.
	heldA := claim(a, "held-through-a")
	heldA2 := claim(a, "held-through-a-2")
	lateA := claim(a, "held-past-grace")
	claim(b, "warm-b")
	oldTokenA, oldTokenB := pageToken(a), pageToken(b)

	rotated, err := rotator.RotateClaimKey(ctx, storage.RotateClaimKeyParams{ActivateAfter: 2 * time.Minute, Grace: 2 * time.Hour})
	require.NoError(t, err)
	require.EqualValues(t, 2, rotated.Keys[0].Generation)

	// Past the activation: A's refresh is due, B's is not.
	clock.Advance(3 * time.Minute)
	after := claim(a, "claimed-after")
	newTokenA := pageToken(a)
	require.Contains(t, a.logs.String(), "current_generation=2", "A logs the generation it issues under")

	// A claim under generation 2 completes through B, which has not read
	// it before the miss.
	require.NoError(t, complete(b, "claimed-after", after))
	// A claim under generation 1 (within the grace) on both.
	require.NoError(t, extend(b, "held-through-a", heldA))
	require.NoError(t, complete(b, "held-through-a", heldA))
	require.NoError(t, complete(a, "held-through-a-2", heldA2))
	// A claim after the rotation through B verifies on A.
	afterB := claim(b, "claimed-after-b")
	require.NoError(t, complete(a, "claimed-after-b", afterB))
	// Page tokens of either replica, of either generation, open on the other.
	for _, tc := range []struct {
		name  string
		r     replica
		token string
	}{{"A's old on B", b, oldTokenA}, {"B's old on A", a, oldTokenB}, {"A's new on B", b, newTokenA}, {"B's new on A", a, pageToken(b)}} {
		_, err := list(tc.r, tc.token)
		require.NoError(t, err, tc.name)
	}

	// After the grace: the old generation is refused, truly.
	clock.Advance(2 * time.Hour)
	for name, r := range map[string]replica{"A": a, "B": b} {
		err := complete(r, "held-past-grace", lateA)
		st := requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
		require.NotContains(t, st.Message(), "another holder", name)
		_, err = list(r, oldTokenA)
		st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
		require.Contains(t, fmt.Sprint(st.Details()), "no longer accepts", name)
		// Generation 2 still works.
		_, err = list(r, newTokenA)
		require.NoError(t, err, name)
	}
	for _, r := range []replica{a, b} {
		logs := r.logs.String()
		require.Contains(t, logs, "claim secret verifies under no accepted claim key generation")
		require.Contains(t, logs, "accepted_generations=2")
		require.False(t, strings.Contains(logs, fmt.Sprintf("%x", rotated.Keys[0].Key)), "no key in the logs")
	}
}
