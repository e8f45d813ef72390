package server_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/configfile"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
	"github.com/idemreg/idemreg/storage/storagetest"
)

func bearer(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "bearer "+token)
}

// TestIdentityRateLimit: an identity granted a prefix that invents
// consumer names, each with a fresh consumer bucket, still takes from one
// bucket of its own; another identity has its own.
func TestIdentityRateLimit(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: team, token_hashes: ["`+access.HashToken("team-token")+`"], consumers: ["team.*"]}
  - {name: other, token_hashes: ["`+access.HashToken("other-token")+`"], consumers: ["other.*"]}
rate_limits:
  - consumers: ["*"]
    rate: 0.001
    burst: 3
  - identities: ["*"]
    rate: 0.001
    burst: 3
`)
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src}))
	lookup := func(token, consumer string) error {
		_, err := c.Lookup(bearer(t.Context(), token), &idemregv1.LookupRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
		return err
	}
	for _, consumer := range []string{"team.a", "team.b", "team.c"} {
		requireStatus(t, lookup("team-token", consumer), codes.NotFound, idemregv1.ReasonNotFound)
	}
	err := lookup("team-token", "team.invented-4")
	st := requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonRateLimited)
	require.Contains(t, st.Message(), `identity "team" is over its rate limit of 0.001 requests per second, burst 3 (rate_limits identities "*")`)
	require.Equal(t, "identity:team", detail[*errdetails.QuotaFailure](t, err).GetViolations()[0].GetSubject())
	require.Positive(t, detail[*errdetails.RetryInfo](t, err).GetRetryDelay().AsDuration())

	requireStatus(t, lookup("other-token", "other.a"), codes.NotFound, idemregv1.ReasonNotFound)
}

// TestIdentityRateLimitRules: a rule naming an identity beats "*", and
// names must be identities of the file.
func TestIdentityRateLimitRules(t *testing.T) {
	cases := []struct {
		name    string
		rules   string
		want    string // the limit of identity "a", or the error
		wantErr bool
	}{
		{"by name beats *", "  - {identities: [\"*\"], rate: 5}\n  - {identities: [a], rate: 1}\n", `1 requests per second, burst 1 (rate_limits identities "a")`, false},
		{"*", "  - {identities: [\"*\"], rate: 5}\n", `5 requests per second, burst 5 (rate_limits identities "*")`, false},
		// Issue 25: an identity is bounded even where no rule says so.
		{"none: the default", "  - {consumers: [\"*\"], rate: 5}\n", `2000 requests per second, burst 4000 (the default of each identity; a rate_limits rule of identities replaces it)`, false},
		{"unknown identity", "  - {identities: [b], rate: 5}\n", `rate_limits[0]: identities[0]: no identity is named "b"`, true},
		{"consumers and identities in one rule", "  - {identities: [a], consumers: [x], rate: 5}\n", "consumers or identities, not both", true},
		{"twice", "  - {identities: [a], rate: 5}\n  - {identities: [a], rate: 6}\n", `rate_limits[1]: identities[0]: "a" is given twice`, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			set, err := access.Parse([]byte("identities:\n  - {name: a, token_hashes: [\"" + access.HashToken("t") + "\"], consumers: [\"a.*\"]}\nrate_limits:\n" + tc.rules))
			if tc.wantErr {
				require.ErrorContains(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			l, ok := set.IdentityRateLimit("a")
			require.True(t, ok)
			require.Equal(t, tc.want, l.String())
		})
	}
	_, err := access.Parse([]byte("rate_limits:\n  - {identities: [\"*\"], rate: 5}\n"))
	require.ErrorContains(t, err, "the file names no identities")
	open, err := access.Parse([]byte("rate_limits:\n  - {consumers: [\"*\"], rate: 5}\n"))
	require.NoError(t, err)
	_, limited := open.IdentityRateLimit(access.Anonymous.Name)
	require.False(t, limited, "no identities, no other tenant: no default")
}

// TestDefaultIdentityRateLimit (issue 25, finding 9): an identity of a file
// without any rule of identities is held to access.DefaultIdentityLimit,
// over the wire: past its burst its calls are RATE_LIMITED naming it,
// while another identity is served.
func TestDefaultIdentityRateLimit(t *testing.T) {
	src := accessFile(t, `
identities:
  - {name: runaway, token_hashes: ["`+access.HashToken("runaway-token")+`"], consumers: ["runaway.*"]}
  - {name: other, token_hashes: ["`+access.HashToken("other-token")+`"], consumers: ["other.*"]}
`)
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{Access: src}))
	ctx := bearer(t.Context(), "runaway-token")
	// A batch's items each take from the bucket: the burst in a few calls.
	var items []*idemregv1.ClaimRequest
	for i := range server.MaxBatchItems {
		items = append(items, &idemregv1.ClaimRequest{Consumer: "runaway.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k" + strconv.Itoa(i)})
	}
	// The batches go at once: one after another, each would have to take
	// its items faster than the bucket refills (500 in 250 ms), which a
	// loaded CI machine under -race does not promise. At once, they ask
	// three bursts' worth in the time it takes to decode them.
	n := 3 * access.DefaultIdentityLimit.Burst / server.MaxBatchItems
	errs := make([]error, n)
	var wg sync.WaitGroup
	for b := range n {
		wg.Go(func() {
			res, err := c.BatchClaim(ctx, &idemregv1.BatchClaimRequest{Requests: items})
			if err != nil {
				errs[b] = err
				return
			}
			for _, r := range res.GetResults() {
				if _, err := claimResult(r); err != nil {
					errs[b] = err
					return
				}
			}
		})
	}
	wg.Wait()
	var limited error
	for _, err := range errs {
		if err != nil && status.Code(err) != codes.OK {
			limited = err
			break
		}
	}
	requireStatus(t, limited, codes.ResourceExhausted, idemregv1.ReasonRateLimited)
	require.Equal(t, "identity:runaway", detail[*errdetails.QuotaFailure](t, limited).GetViolations()[0].GetSubject())
	require.Contains(t, status.Convert(limited).Message(), "the default of each identity")

	_, err := c.Claim(bearer(t.Context(), "other-token"), &idemregv1.ClaimRequest{Consumer: "other.a", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
	require.NoError(t, err, "another identity has its own bucket")
}

// TestInFlightShareIsolatesIdentities: an identity whose calls wait on the
// store (here Extends queued on a row lock PostgreSQL holds for another
// transaction) takes at most its share of --max-in-flight; its calls
// beyond it fail OVERLOADED at once, naming it, and another identity's
// calls still run.
func TestInFlightShareIsolatesIdentities(t *testing.T) {
	db := pgtest.NewDatabase(t)
	pgtest.RequirePostgreSQL(t, db, "it watches pg_stat_activity's lock waits")
	store, err := postgres.Open(t.Context(), db+"&pool_max_conns=16")
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	src := accessFile(t, `
identities:
  - {name: flood, token_hashes: ["`+access.HashToken("flood-token")+`"], consumers: ["flood.*"]}
  - {name: calm, token_hashes: ["`+access.HashToken("calm-token")+`"], consumers: ["calm.*"]}
`)
	const maxInFlight = 4 // so each identity may have 2
	c := idemregv1.NewRegistryServiceClient(start(t, store, server.Config{
		Access: src, MaxInFlight: maxInFlight, RequestTimeout: 30 * time.Second}))
	flood, calm := bearer(t.Context(), "flood-token"), bearer(t.Context(), "calm-token")
	claimed, err := c.Claim(flood, &idemregv1.ClaimRequest{Consumer: "flood.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "slow", Lease: durationpb.New(time.Minute)})
	require.NoError(t, err)

	conn, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	_, err = tx.Exec(t.Context(), `SELECT 1 FROM idemreg_records WHERE consumer = 'flood.a' AND key = 'slow' FOR UPDATE`)
	require.NoError(t, err)
	// Another session watches: pg_stat_activity is a snapshot per
	// transaction, so the locking one would never see the waiters come.
	watch, err := pgx.Connect(t.Context(), db)
	require.NoError(t, err)
	t.Cleanup(func() { _ = watch.Close(context.Background()) })
	lockWaiters := func() int {
		var n int
		require.NoError(t, watch.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`).Scan(&n))
		return n
	}

	// The flood: as many Extends as the server has slots, one after the
	// other, each either queued on the lock or refused before the next.
	results := make(chan error, maxInFlight)
	var refused []error
	for i := range maxInFlight {
		go func() {
			_, err := c.Extend(flood, &idemregv1.ExtendRequest{Consumer: "flood.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "slow", Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret()})
			results <- err
		}()
		require.Eventually(t, func() bool {
			select {
			case err := <-results:
				refused = append(refused, err)
			default:
			}
			return lockWaiters()+len(refused) == i+1
		}, 20*time.Second, 5*time.Millisecond)
	}
	// The other identity's calls run meanwhile.
	_, err = c.Claim(calm, &idemregv1.ClaimRequest{Consumer: "calm.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k"})
	require.NoError(t, err, "another identity's call must not fail for the flood")
	require.Equal(t, maxInFlight/2, lockWaiters(), "the flooding identity holds its share, no more")
	require.Len(t, refused, maxInFlight/2)
	for _, err := range refused {
		st := requireStatus(t, err, codes.Unavailable, idemregv1.ReasonOverloaded)
		require.Contains(t, st.Message(), `identity "flood" already has 2 store operations in flight, its share`)
		require.Equal(t, "identity:flood", detail[*errdetails.QuotaFailure](t, err).GetViolations()[0].GetSubject())
		require.Positive(t, detail[*errdetails.RetryInfo](t, err).GetRetryDelay().AsDuration())
	}

	require.NoError(t, tx.Rollback(t.Context()))
	for range maxInFlight / 2 {
		require.NoError(t, <-results, "the queued Extends finish once the lock is gone")
	}
	_, err = c.Extend(flood, &idemregv1.ExtendRequest{Consumer: "flood.a", Kind: idemregv1.Kind_KIND_OPERATION, Key: "slow", Token: claimed.GetToken(), ClaimSecret: claimed.GetClaimSecret()})
	require.NoError(t, err, "the share is given back")
}

// TestMaxLeaseTotal: on both stores, Extend cannot hold a key past the
// consumer's max_lease_total since the attempt began: it is refused with
// FAILED_PRECONDITION, LEASE_TOTAL_EXCEEDED, saying until when a lease may
// run, and the lease in force stays. The server's default applies to
// consumers the file leaves alone; a takeover starts afresh.
func TestMaxLeaseTotal(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "policy.yaml")
			require.NoError(t, os.WriteFile(path, []byte(`
consumers:
  - name: short.worker
    lease: {max: 1m}
    max_lease_total: 1m
  - name: unbounded.worker
    max_lease_total: 0s
`), 0o600))
			src, err := configfile.Open(path, server.DefaultLimits().Policy())
			require.NoError(t, err)
			clock := &storagetest.Clock{}
			conn := start(t, b.open(t, clock), server.Config{File: src})
			c := idemregv1.NewRegistryServiceClient(conn)
			key := func(consumer string) (*idemregv1.ClaimRequest, func(lease time.Duration) (*idemregv1.ExtendResponse, error)) {
				req := &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "job", Lease: durationpb.New(10 * time.Second),
					Retention: durationpb.New(7 * 24 * time.Hour)}
				var (
					token  int64
					secret []byte
				)
				claim := func() {
					res, err := c.Claim(t.Context(), req)
					require.NoError(t, err)
					require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
					token, secret = res.GetToken(), res.GetClaimSecret()
				}
				claim()
				return req, func(lease time.Duration) (*idemregv1.ExtendResponse, error) {
					if lease < 0 { // claim again: a takeover
						claim()
						return nil, nil
					}
					return c.Extend(t.Context(), &idemregv1.ExtendRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "job",
						Token: token, ClaimSecret: secret, Lease: durationpb.New(lease)})
				}
			}

			// A consumer's own bound: 1 minute.
			_, extend := key("short.worker")
			clock.Advance(5 * time.Second)
			ext, err := extend(30 * time.Second) // to 35 s
			require.NoError(t, err)
			clock.Advance(20 * time.Second)
			_, err = extend(40 * time.Second) // to 65 s
			st := requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseTotalExceeded)
			require.Contains(t, st.Message(), `one attempt may hold the key for at most 1m0s (max_lease_total of consumer "short.worker"), so no lease of this attempt may end after `)
			require.Contains(t, st.Message(), "; the lease in force is unchanged")
			var info *errdetails.ErrorInfo
			for _, d := range st.Details() {
				if i, ok := d.(*errdetails.ErrorInfo); ok {
					info = i
				}
			}
			notAfter, perr := time.Parse(time.RFC3339Nano, info.GetMetadata()["lease_not_after"])
			require.NoError(t, perr)
			require.Equal(t, ext.GetRecord().GetCreatedAt().AsTime().Add(time.Minute), notAfter, "a minute from the attempt's start")
			require.Equal(t, "1m0s", info.GetMetadata()["max_lease_total"])
			require.ErrorIs(t, client.FromError(err), client.ErrLeaseTotalExceeded)
			got, err := c.Lookup(t.Context(), &idemregv1.LookupRequest{Consumer: "short.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "job"})
			require.NoError(t, err)
			require.True(t, ext.GetRecord().GetLeaseExpiresAt().AsTime().Equal(got.GetRecord().GetLeaseExpiresAt().AsTime()), "the lease in force stays")
			_, err = extend(30 * time.Second) // to 55 s
			require.NoError(t, err, "what is left can still be taken")
			clock.Advance(time.Minute)
			_, _ = extend(-1)                 // the lease ran out: a takeover, a new attempt
			_, err = extend(50 * time.Second) // the first attempt's total ended at 60 s
			require.NoError(t, err, "a takeover starts a total of its own")

			// The server's default, 24 hours, for consumers the file leaves alone.
			_, extend = key("billing.worker")
			clock.Advance(server.DefaultMaxLeaseTotal - 30*time.Minute)
			_, err = extend(time.Hour)
			requireStatus(t, err, codes.FailedPrecondition, idemregv1.ReasonLeaseTotalExceeded)
			_, err = extend(20 * time.Minute)
			require.NoError(t, err)

			// 0s: no bound.
			_, extend = key("unbounded.worker")
			clock.Advance(server.DefaultMaxLeaseTotal + time.Hour)
			_, err = extend(time.Hour)
			require.NoError(t, err)
		})
	}
}

// TestReloadDuringRequests races reloads of a config file between two
// versions with calls: every call is served under one version whole (its
// grant and its policy from the same file), never the grant of one and
// the policy of the other.
func TestReloadDuringRequests(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "idemreg.yaml")
	version := func(prefix, lease string) []byte {
		return []byte("consumers:\n  - {prefix: " + prefix + "., lease: {default: " + lease + "}}\n" +
			"identities:\n  - {name: t, token_hashes: [\"" + access.HashToken("t-token") + "\"], consumers: [\"" + prefix + ".*\"]}\n")
	}
	versions := [][]byte{version("a", "1m"), version("b", "2m")}
	install := func(i int) { // atomically, so that every read sees a whole file
		tmp := filepath.Join(dir, "next.yaml")
		require.NoError(t, os.WriteFile(tmp, versions[i], 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}
	install(0)
	src, err := configfile.Open(path, server.DefaultLimits().Policy())
	require.NoError(t, err)
	c := idemregv1.NewRegistryServiceClient(start(t, memStore(t), server.Config{File: src}))
	ctx := bearer(t.Context(), "t-token")

	stop := make(chan struct{})
	reloaded := make(chan int)
	go func() {
		n := 0
		defer func() { reloaded <- n }()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			install(i % 2)
			_, err := src.Reload()
			if !assert.NoError(t, err) {
				return
			}
			n++
		}
	}()
	want := map[string]time.Duration{"a.x": time.Minute, "b.x": 2 * time.Minute}
	var wg sync.WaitGroup
	var served atomic.Int64
	for g := range 4 {
		wg.Go(func() {
			for i := range 400 {
				consumer := []string{"a.x", "b.x"}[i%2]
				res, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION,
					Key: fmt.Sprintf("k-%d-%d", g, i)})
				if status.Code(err) == codes.PermissionDenied {
					continue // the other version was in force
				}
				if !assert.NoError(t, err) {
					return
				}
				served.Add(1)
				r := res.GetRecord()
				assert.Equal(t, want[consumer], r.GetLeaseExpiresAt().AsTime().Sub(r.GetCreatedAt().AsTime()),
					"%s was admitted under one version and given the policy of the other", consumer)
			}
		})
	}
	wg.Wait()
	close(stop)
	require.Positive(t, <-reloaded)
	require.Positive(t, served.Load())
}
