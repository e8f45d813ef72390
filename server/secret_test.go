package server_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// TestClaimSecretCannotBeDerived plays a caller allowed to use the consumer
// that did not acquire the claim: it sees every answer a non-holder can
// get (Lookup, an in-progress Claim, and after a takeover the same again),
// derives the token from their times as the store's clock makes it, and
// tries Complete, Release and Extend with that token (and the true one)
// and, as the secret, every 16-byte window of every answer it saw. Every
// try is CLAIM_SECRET_INVALID (not LEASE_LOST: nobody took over) and
// changes nothing; the stale holder's own token and secret are LEASE_LOST;
// the holders then complete, and the stored result is theirs.
func TestClaimSecretCannotBeDerived(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		const key = "charge-1"
		claim := claimReq(key, "fp")
		claim.Lease = durationpb.New(2 * time.Second)
		claim.RequestId = "holder-a-1"
		holder, err := c.Claim(ctx, claim)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, holder.GetOutcome())
		require.Len(t, holder.GetClaimSecret(), server.ClaimSecretSize)

		// A repeat of the holder's own Claim (a lost reply) is as good as
		// the first answer; it is the holder's.
		repeat, err := c.Claim(ctx, claim)
		require.NoError(t, err)
		require.Equal(t, holder.GetToken(), repeat.GetToken())
		require.Equal(t, holder.GetClaimSecret(), repeat.GetClaimSecret())

		// What everyone else sees.
		observe := func() [][]byte {
			other := claimReq(key, "fp")
			other.Holder = "intruder"
			inProgress, err := c.Claim(ctx, other)
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_IN_PROGRESS, inProgress.GetOutcome())
			require.Empty(t, inProgress.GetClaimSecret())
			looked, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key})
			require.NoError(t, err)
			var seen [][]byte
			for _, m := range []proto.Message{inProgress, looked} {
				b, err := proto.Marshal(m)
				require.NoError(t, err)
				seen = append(seen, b)
			}
			return seen
		}

		// attack tries every token it can derive from rec, plus the true
		// one, with every secret it can cut from seen.
		attack := func(rec *idemregv1.Record, trueToken int64, seen [][]byte) {
			created := rec.GetCreatedAt().AsTime().UnixMicro()
			leaseStart := rec.GetLeaseExpiresAt().AsTime().Add(-2 * time.Second).UnixMicro()
			tokens := []int64{trueToken, created, created + 1, leaseStart, leaseStart + 1}
			var secrets [][]byte
			for _, b := range seen {
				require.False(t, bytes.Contains(b, holder.GetClaimSecret()), "an answer to a non-holder carries the secret")
				for i := 0; i+server.ClaimSecretSize <= len(b); i++ {
					secrets = append(secrets, b[i:i+server.ClaimSecretSize])
				}
			}
			secrets = append(secrets, make([]byte, server.ClaimSecretSize))
			require.Contains(t, tokens[1:], trueToken, "the token itself follows from the answers")
			tries := 0
			for _, tok := range tokens {
				for _, s := range secrets {
					_, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
						Token: tok, ClaimSecret: s, Result: response("intruder")})
					requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
					_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
						Token: tok, ClaimSecret: s})
					requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
					_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
						Token: tok, ClaimSecret: s})
					requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
					tries++
				}
			}
			t.Logf("%d tokens × %d secrets refused", len(tokens), len(secrets))
			require.Greater(t, tries, 100)
		}

		seen := observe()
		looked, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key})
		require.NoError(t, err)
		attack(looked.GetRecord(), holder.GetToken(), seen)

		// After a takeover the token shows as lease_expires_at - lease.
		h.clock.Advance(3 * time.Second)
		second := claimReq(key, "fp")
		second.Lease = durationpb.New(2 * time.Second)
		takeover, err := c.Claim(ctx, second)
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, takeover.GetOutcome())
		require.EqualValues(t, 2, takeover.GetRecord().GetAttempt())
		require.NotEqual(t, holder.GetClaimSecret(), takeover.GetClaimSecret())
		seen = append(seen, observe()...)
		looked, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key})
		require.NoError(t, err)
		attack(looked.GetRecord(), takeover.GetToken(), seen)

		// The stale holder with its own token and secret: truly lost.
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
			Token: holder.GetToken(), ClaimSecret: holder.GetClaimSecret(), Result: response("stale holder")})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseLost)

		// The first holder's secret does not carry over to the new token.
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
			Token: takeover.GetToken(), ClaimSecret: holder.GetClaimSecret(), Result: response("stale holder")})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)

		// Nothing the attacks did is visible: the current holder completes.
		done, err := c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
			Token: takeover.GetToken(), ClaimSecret: takeover.GetClaimSecret(), Result: response("charged")})
		require.NoError(t, err)
		require.Equal(t, "charged", string(done.GetRecord().GetResult().GetResponse().GetData()))
		require.EqualValues(t, 2, done.GetRecord().GetAttempt())

		// A completed record shows its token; it still proves nothing.
		replay, err := c.Claim(ctx, claimReq(key, "fp"))
		require.NoError(t, err)
		require.Equal(t, idemregv1.Outcome_OUTCOME_COMPLETED, replay.GetOutcome())
		require.Equal(t, takeover.GetToken(), replay.GetRecord().GetToken())
		require.Empty(t, replay.GetClaimSecret())
		_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: claim.Consumer, Kind: claim.Kind, Key: key,
			Token: replay.GetRecord().GetToken(), ClaimSecret: forged})
		requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonClaimSecretInvalid)
	})
}

// TestClaimSecretIsRequired: a Complete, Release or Extend without the
// claim's secret (an old client) is INVALID_ARGUMENT naming the field,
// before anything is read.
func TestClaimSecretIsRequired(t *testing.T) {
	forEachBackend(t, func(t *testing.T, h *harness) {
		ctx, c := t.Context(), h.client
		cl, err := c.Claim(ctx, claimReq("op-1", ""))
		require.NoError(t, err)
		k := claimReq("op-1", "")
		for _, secret := range [][]byte{nil, cl.GetClaimSecret()[:server.ClaimSecretSize-1], append(cl.GetClaimSecret(), 0)} {
			_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: cl.GetToken(), ClaimSecret: secret, Result: response("r")})
			st := requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, []string{"claim_secret"}, violatedFields(st))
			_, err = c.Release(ctx, &idemregv1.ReleaseRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: cl.GetToken(), ClaimSecret: secret})
			st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, []string{"claim_secret"}, violatedFields(st))
			_, err = c.Extend(ctx, &idemregv1.ExtendRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: cl.GetToken(), ClaimSecret: secret})
			st = requireStatus(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
			require.Equal(t, []string{"claim_secret"}, violatedFields(st))
		}
		_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: cl.GetToken(), ClaimSecret: cl.GetClaimSecret(), Result: response("r")})
		require.NoError(t, err, "the claim was untouched")
	})
}
