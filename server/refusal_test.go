package server_test

import (
	"context"
	"strconv"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
)

// refusalFile grants the identity team the consumers team.*, limits them
// to a burst of one call each, and names a second identity.
func refusalFile(t testing.TB) *access.Set {
	return accessFile(t, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
  - {name: other, token_hashes: ["`+access.HashToken("other-token")+`"], consumers: ["other.*"]}
rate_limits:
  - consumers: ["team.limited*"]
    rate: 0.001
    burst: 1
  - identities: ["team"] # FuzzRefusals calls faster than the default rate of an identity
    rate: 1000000000
    burst: 1000000000
`)
}

// requireEncodableRefusal checks that err is a refusal with code and
// reason whose every text is valid UTF-8 (the status went over the wire
// whole, details included) and returns its ErrorInfo metadata.
func requireEncodableRefusal(t *testing.T, err error, code codes.Code, reason string) map[string]string {
	t.Helper()
	st := requireStatus(t, err, code, reason)
	require.True(t, utf8.ValidString(st.Message()), "message %q", st.Message())
	_, merr := proto.Marshal(st.Proto())
	require.NoError(t, merr, "the status encodes, so a batch item can carry it")
	return detail[*errdetails.ErrorInfo](t, err).GetMetadata()
}

// TestBatchItemRefusalNeverHidesCommittedItems (issue 25, finding 4): a
// batch with a good item and an item naming a consumer the caller may not
// use, in invalid UTF-8. The refusal quoted the raw bytes in a
// google.rpc.Status, which protobuf cannot encode: the whole answer was
// INTERNAL, the good Claim's token and secret never reached the caller
// (the key stayed acquired), the good Complete was stored while the
// caller was told INTERNAL, and the access log said OK. Now the good item
// gets its answer, the bad one its refusal with ErrorInfo, and the log
// line says what the caller got.
func TestBatchItemRefusalNeverHidesCommittedItems(t *testing.T) {
	var logs syncBuffer
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: refusalFile(t), Logger: jsonLogger(&logs)}))
	ctx := bearer(t.Context(), "team-token")
	const op = idemregv1.Kind_KIND_OPERATION
	bad := []struct {
		name, consumer string
		code           codes.Code
		reason         string
		metaConsumer   string
	}{
		{"ungranted, invalid UTF-8", "other.\xff\xfe", codes.PermissionDenied, idemregv1.ReasonPermissionDenied, `other.\xff\xfe`},
		{"ungranted, control characters", "other.\x00\n", codes.PermissionDenied, idemregv1.ReasonPermissionDenied, `other.\x00\n`},
		// Granted by the prefix, refused by the consumer's rate limit on
		// its second call: the limit quotes the consumer too.
		{"rate limited, invalid UTF-8", "team.limited\xc3\x28", codes.ResourceExhausted, idemregv1.ReasonRateLimited, `team.limited\xc3(`},
	}
	lines := 0
	for i, b := range bad {
		t.Run(b.name, func(t *testing.T) {
			if b.code == codes.ResourceExhausted { // spend the burst
				_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: b.consumer, Kind: op, Key: "k"})
				requireEncodableRefusal(t, err, codes.InvalidArgument, idemregv1.ReasonInvalidArgument)
				lines++
			}
			// BatchClaim: the good item is acquired and its token and
			// secret reach the caller.
			goodKey := "claim-" + string(rune('a'+i))
			res, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
				{Consumer: "team.a", Kind: op, Key: goodKey},
				{Consumer: b.consumer, Kind: op, Key: "k"},
			}})
			require.NoError(t, err, "the batch is answered")
			lines++
			got, err := claimResult(res.GetResults()[0])
			require.NoError(t, err)
			require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, got.GetOutcome())
			require.NotZero(t, got.GetToken())
			require.Len(t, got.GetClaimSecret(), server.ClaimSecretSize)
			_, err = claimResult(res.GetResults()[1])
			meta := requireEncodableRefusal(t, err, b.code, b.reason)
			require.Equal(t, b.metaConsumer, meta["consumer"], "escaped, not raw")

			// BatchComplete: the good item is stored and the caller is
			// told so.
			cres, err := c.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: []*idemregv1.CompleteRequest{
				{Consumer: "team.a", Kind: op, Key: goodKey, Token: got.GetToken(), ClaimSecret: got.GetClaimSecret(), Result: response("done")},
				{Consumer: b.consumer, Kind: op, Key: "k", Token: got.GetToken(), ClaimSecret: got.GetClaimSecret(), Result: response("x")},
			}})
			require.NoError(t, err, "the batch is answered")
			lines++
			done, err := completeResult(cres.GetResults()[0])
			require.NoError(t, err)
			require.Equal(t, idemregv1.State_STATE_COMPLETED, done.GetRecord().GetState())
			_, err = completeResult(cres.GetResults()[1])
			requireEncodableRefusal(t, err, b.code, b.reason)

			// Unary, the same refusal carries its ErrorInfo (it went
			// without when the metadata did not encode).
			_, err = c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: b.consumer, Kind: op, Key: "k"})
			meta = requireEncodableRefusal(t, err, b.code, b.reason)
			require.Equal(t, b.metaConsumer, meta["consumer"])
			lines++

			// The access log says what the caller got, and quotes the
			// consumer escaped.
			// Lines are written as calls end, after their responses went
			// out, so the burst's Claim may log after the batches: the
			// three calls above are found by method, the last of each.
			calls := logs.waitLines(t, "finished call", lines)
			last := map[string]map[string]any{}
			for _, l := range calls {
				if m, _ := l["grpc.method"].(string); m == "BatchClaim" || m == "BatchComplete" || m == "Lookup" {
					last[m] = l
				}
			}
			require.Len(t, last, 3, "the batches' and the Lookup's lines")
			for _, l := range last {
				want := "OK"
				if l["grpc.method"] == "Lookup" {
					want = rpccode.Code(b.code).String()
					require.Equal(t, b.metaConsumer, l["consumer"])
				}
				require.Equal(t, want, l["grpc.code"], "%v", l)
			}
		})
	}
}

// FuzzRefusals sends fuzzed consumers and keys over the wire to a server
// with identities, alone and in a batch beside a good item: no input
// makes the server answer INTERNAL, every refusal carries ErrorInfo and
// encodes, and the good item is always answered.
func FuzzRefusals(f *testing.F) {
	for _, s := range []string{"team.a", "other.a", "other.\xff", "team.\xff", "team.limited\x00", "\xc3\x28", "", "a\u200bb", "x\n"} {
		f.Add(s, "k", false)
		f.Add(s, "k\xff", true)
	}
	addr, _ := servertest.Serve(f, memStore(f), server.Config{Access: refusalFile(f)})
	c := idemregv1.NewRegistryServiceClient(servertest.Dial(f, addr))
	n := 0
	f.Fuzz(func(t *testing.T, consumer, key string, complete bool) {
		ctx := bearer(context.Background(), "team-token")
		n++
		check := func(err error) {
			t.Helper()
			if err == nil {
				return
			}
			st := status.Convert(err)
			require.NotEqual(t, codes.Internal, st.Code(), "%q %q: %v", consumer, key, st.Message())
			requireEncodableRefusal(t, err, st.Code(), detail[*errdetails.ErrorInfo](t, err).GetReason())
		}
		const op = idemregv1.Kind_KIND_OPERATION
		_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: op, Key: key})
		check(err)
		good := "fuzz-" + strconv.Itoa(n)
		res, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: []*idemregv1.ClaimRequest{
			{Consumer: "team.a", Kind: op, Key: good}, {Consumer: consumer, Kind: op, Key: key}}})
		require.NoError(t, err, "%q %q", consumer, key)
		acquired, err := claimResult(res.GetResults()[0])
		require.NoError(t, err)
		_, err = claimResult(res.GetResults()[1])
		check(err)
		if !complete {
			return
		}
		cres, err := c.BatchComplete(ctx, &idemregv1.BatchCompleteRequest{Requests: []*idemregv1.CompleteRequest{
			{Consumer: "team.a", Kind: op, Key: good, Token: acquired.GetToken(), ClaimSecret: acquired.GetClaimSecret(), Result: response("r")},
			{Consumer: consumer, Kind: op, Key: key, Token: 1, ClaimSecret: forged, Result: response("r")}}})
		require.NoError(t, err, "%q %q", consumer, key)
		_, err = completeResult(cres.GetResults()[0])
		require.NoError(t, err)
		_, err = completeResult(cres.GetResults()[1])
		check(err)
	})
}

// TestRefusalFloodLogsSampled (issue 25, finding 9): a flood of refused
// calls from one identity wrote a line each. Now its lines are sampled
// (RefusalLogRate a second per identity and code), every refusal is still
// counted (idemreg.auth.denied, and idemreg.access_log.sampled_out for the
// lines left out), and the lines of other identities and of successful
// calls are all written.
func TestRefusalFloodLogsSampled(t *testing.T) {
	var logs syncBuffer
	reader := sdkmetric.NewManualReader()
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: refusalFile(t), Logger: jsonLogger(&logs),
		RefusalLogRate: 3, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}))
	team, other := bearer(t.Context(), "team-token"), bearer(t.Context(), "other-token")
	const flood = 200
	for range flood {
		_, err := c.Lookup(team, &idemregv1.LookupRequest{Consumer: "other.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
		requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	}
	for range 3 {
		_, err := c.Lookup(other, &idemregv1.LookupRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
		requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	}
	_, err := c.Claim(team, &idemregv1.ClaimRequest{Consumer: "team.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
	require.NoError(t, err)

	// Each line is written, or left out, as its call ends, after the
	// caller has its answer: wait until every call is accounted for.
	denied := func(identity string) (n int64) {
		for _, l := range logs.lines(t, "finished call") {
			if l["identity"] == identity && l["grpc.code"] == "PERMISSION_DENIED" {
				n++
			}
		}
		return n
	}
	require.Eventually(t, func() bool {
		return denied("team")+collectSums(t, reader)[server.MetricLogSampled+" code=PERMISSION_DENIED"] == flood &&
			denied("other") == 3 && len(logs.lines(t, "finished call")) > int(denied("team")+denied("other"))
	}, 10*time.Second, 10*time.Millisecond, "every refusal logged or counted as left out")
	require.Less(t, denied("team"), int64(flood/2), "the flood's lines are sampled")
	require.Equal(t, int64(flood+3), collectSums(t, reader)[server.MetricDenied+" code=PERMISSION_DENIED"], "every refusal counted")
}
