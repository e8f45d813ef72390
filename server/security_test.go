package server_test

import (
	"context"
	"crypto/tls"
	"crypto/x509/pkix"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage"
	"github.com/idemreg/idemreg/storage/pebble"
	"github.com/idemreg/idemreg/storage/storagetest"
)

// spyStore counts the calls that reach the store, to prove a refused call
// read nothing.
type spyStore struct {
	storage.Store
	calls atomic.Int64
}

func (s *spyStore) Claim(ctx context.Context, p storage.ClaimParams) (storage.ClaimResult, error) {
	s.calls.Add(1)
	return s.Store.Claim(ctx, p)
}

func (s *spyStore) Complete(ctx context.Context, p storage.CompleteParams) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.Complete(ctx, p)
}

func (s *spyStore) Release(ctx context.Context, p storage.ReleaseParams) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.Release(ctx, p)
}

func (s *spyStore) Extend(ctx context.Context, p storage.ExtendParams) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.Extend(ctx, p)
}

func (s *spyStore) Lookup(ctx context.Context, k storage.Key) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.Lookup(ctx, k)
}

func (s *spyStore) Inspect(ctx context.Context, k storage.Key) (storage.InspectResult, error) {
	s.calls.Add(1)
	return s.Store.(storage.Admin).Inspect(ctx, k)
}

func (s *spyStore) Invalidate(ctx context.Context, p storage.InvalidateParams) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.(storage.Admin).Invalidate(ctx, p)
}

func (s *spyStore) Resolve(ctx context.Context, p storage.ResolveParams) (storage.Record, error) {
	s.calls.Add(1)
	return s.Store.(storage.Admin).Resolve(ctx, p)
}

func (s *spyStore) List(ctx context.Context, p storage.ListParams) (storage.ListResult, error) {
	s.calls.Add(1)
	return s.Store.(storage.Admin).List(ctx, p)
}

func (s *spyStore) CountParked(ctx context.Context, prefix string) (map[string]int64, error) {
	s.calls.Add(1)
	return s.Store.(storage.Admin).CountParked(ctx, prefix)
}

// serve starts a server on a loopback listener until the test ends and
// returns its address.
func serve(t *testing.T, store storage.Store, cfg server.Config) (string, *server.Server) {
	t.Helper()
	return servertest.Serve(t, store, cfg)
}

func dial(t *testing.T, addr string, tlsCfg *tls.Config, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg))}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func accessFile(t testing.TB, doc string) *access.Set {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idemreg.yaml")
	require.NoError(t, os.WriteFile(path, []byte(doc), 0o600))
	set, err := access.Load(path)
	require.NoError(t, err)
	return set
}

func memStore(t testing.TB) storage.Store {
	t.Helper()
	s, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// teamCall runs one RegistryService or AdminService call for consumer and
// key, with the token given, and returns its error.
type teamCall struct {
	name string
	call func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, token int64) error
}

var everyCall = []teamCall{
	{"Claim", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, _ int64) error {
		_, err := idemregv1.NewRegistryServiceClient(conn).Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
		return err
	}},
	{"Complete", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, token int64) error {
		_, err := idemregv1.NewRegistryServiceClient(conn).Complete(ctx, &idemregv1.CompleteRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: token, ClaimSecret: forged, Result: response("stolen")})
		return err
	}},
	{"Release", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, token int64) error {
		_, err := idemregv1.NewRegistryServiceClient(conn).Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: token, ClaimSecret: forged})
		return err
	}},
	{"Extend", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, token int64) error {
		_, err := idemregv1.NewRegistryServiceClient(conn).Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Token: token, ClaimSecret: forged})
		return err
	}},
	{"Lookup", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, _ int64) error {
		_, err := idemregv1.NewRegistryServiceClient(conn).Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
		return err
	}},
	{"InspectRecord", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, _ int64) error {
		_, err := idemregv1.NewAdminServiceClient(conn).InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key})
		return err
	}},
	{"InvalidateRecord", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, _ int64) error {
		_, err := idemregv1.NewAdminServiceClient(conn).InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key, Reason: "test"})
		return err
	}},
	{"ResolveRecord", func(ctx context.Context, conn *grpc.ClientConn, consumer, key string, token int64) error {
		_, err := idemregv1.NewAdminServiceClient(conn).ResolveRecord(ctx, &idemregv1.ResolveRecordRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: key,
			Token: token, Reason: "test", Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
		return err
	}},
	{"ListRecords", func(ctx context.Context, conn *grpc.ClientConn, consumer, _ string, _ int64) error {
		_, err := idemregv1.NewAdminServiceClient(conn).ListRecords(ctx, &idemregv1.ListRecordsRequest{Consumer: consumer})
		return err
	}},
}

// TestTeamIsolationMTLS: two identities, each allowed one consumer and
// identified by its client certificate over mTLS (a URI SAN for one, a DNS
// SAN for the other), on both backends. Neither can claim, complete,
// release, extend, look up, inspect, invalidate, resolve or list the
// other's keys — not even with the other's real token — and every refusal
// is PERMISSION_DENIED whether the key exists or not, decided before the
// store is called.
func TestTeamIsolationMTLS(t *testing.T) {
	ca := newPKI(t, "test CA")
	srvCert := ca.issue("server", true, nil, nil, pkix.Name{CommonName: "idemreg"})
	billingCert := ca.issue("billing", false, []string{"spiffe://test.example/ns/billing/sa/worker"}, nil, pkix.Name{CommonName: "billing"})
	ordersCert := ca.issue("orders", false, nil, []string{"inbox.orders.svc"}, pkix.Name{CommonName: "orders"})
	strangerCert := ca.issue("stranger", false, []string{"spiffe://test.example/ns/other/sa/x"}, nil, pkix.Name{CommonName: "stranger"})
	tlsCfg, err := server.TLSConfig(server.TLSFiles{CertFile: srvCert.certFile, KeyFile: srvCert.keyFile, ClientCAFile: ca.caFile()}, nil)
	require.NoError(t, err)
	src := accessFile(t, `
identities:
  - name: billing
    uris: ["spiffe://test.example/ns/billing/sa/worker"]
    consumers: ["billing.worker"]
    admin: ["billing.worker"]
  - name: orders
    dns_names: ["inbox.orders.svc"]
    consumers: ["orders.inbox"]
    admin: ["orders.inbox"]
`)
	teams := []struct {
		name, consumer string
		cert           *issued
	}{{"billing", "billing.worker", &billingCert}, {"orders", "orders.inbox", &ordersCert}}

	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			spy := &spyStore{Store: b.open(t, &storagetest.Clock{})}
			addr, _ := serve(t, spy, server.Config{TLS: tlsCfg, Access: src})
			ctx := t.Context()
			conns := map[string]*grpc.ClientConn{}
			tokens := map[string]int64{}
			secrets := map[string][]byte{}
			for _, team := range teams {
				conn := dial(t, addr, ca.clientTLS(team.cert))
				conns[team.name] = conn
				res, err := idemregv1.NewRegistryServiceClient(conn).Claim(ctx, &idemregv1.ClaimRequest{Consumer: team.consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
				require.NoError(t, err, "%s uses its own consumer", team.name)
				require.Equal(t, idemregv1.Outcome_OUTCOME_ACQUIRED, res.GetOutcome())
				tokens[team.name] = res.GetToken()
				secrets[team.name] = res.GetClaimSecret()
			}

			for _, caller := range teams {
				for _, victim := range teams {
					if caller.name == victim.name {
						continue
					}
					for _, call := range everyCall {
						for _, key := range []string{"shared-key", "missing-key"} {
							t.Run(caller.name+"/"+victim.name+"/"+call.name+"/"+key, func(t *testing.T) {
								before := spy.calls.Load()
								err := call.call(ctx, conns[caller.name], victim.consumer, key, tokens[victim.name])
								st := requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
								require.Equal(t, `identity "`+caller.name+`" may not use consumer "`+victim.consumer+`"`, st.Message(),
									"the same answer for a key that exists and one that does not")
								require.Equal(t, before, spy.calls.Load(), "refused before the store was called")
							})
						}
					}
				}
			}

			// The victims' records are untouched: each team completes its own key.
			for _, team := range teams {
				c := idemregv1.NewRegistryServiceClient(conns[team.name])
				got, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: team.consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
				require.NoError(t, err)
				require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, got.GetRecord().GetState())
				require.EqualValues(t, 1, got.GetRecord().GetAttempt())
				_, err = c.Complete(ctx, &idemregv1.CompleteRequest{Consumer: team.consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key", Token: tokens[team.name], ClaimSecret: secrets[team.name], Result: response(team.name)})
				require.NoError(t, err)
				insp, err := idemregv1.NewAdminServiceClient(conns[team.name]).InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: team.consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
				require.NoError(t, err, "each team administers its own consumer")
				require.Equal(t, team.name, string(insp.GetRecord().GetResult().GetResponse().GetData()))
			}

			// A certificate from the same CA that names no identity.
			_, err := idemregv1.NewRegistryServiceClient(dial(t, addr, ca.clientTLS(&strangerCert))).Lookup(ctx,
				&idemregv1.LookupRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
			requireStatus(t, err, codes.Unauthenticated, idemregv1.ReasonUnauthenticated)

			// Without a client certificate, the handshake itself fails.
			_, err = idemregv1.NewRegistryServiceClient(dial(t, addr, ca.clientTLS(nil))).Lookup(ctx,
				&idemregv1.LookupRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
			require.Equal(t, codes.Unavailable, statusCode(err))

			// A certificate from another CA is refused by the handshake.
			other := newPKI(t, "other CA")
			forged := other.issue("forged", false, []string{"spiffe://test.example/ns/billing/sa/worker"}, nil, pkix.Name{CommonName: "billing"})
			forgedTLS := ca.clientTLS(&forged)
			_, err = idemregv1.NewRegistryServiceClient(dial(t, addr, forgedTLS)).Lookup(ctx,
				&idemregv1.LookupRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "shared-key"})
			require.Equal(t, codes.Unavailable, statusCode(err))
		})
	}
}

// TestBearerTokens serves TLS without client certificates; identities
// present bearer tokens whose SHA-256 the config file holds.
func TestBearerTokens(t *testing.T) {
	ca := newPKI(t, "test CA")
	srvCert := ca.issue("server", true, nil, nil, pkix.Name{CommonName: "idemreg"})
	tlsCfg, err := server.TLSConfig(server.TLSFiles{CertFile: srvCert.certFile, KeyFile: srvCert.keyFile}, nil)
	require.NoError(t, err)
	const billingToken, ordersToken = "billing-token-0123456789abcdef", "orders-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: billing
    token_hashes: ["`+access.HashToken(billingToken)+`"]
    consumers: ["billing.*"]
  - name: orders
    token_hashes: ["`+access.HashToken(ordersToken)+`"]
    consumers: ["orders.inbox"]
`)
	spy := &spyStore{Store: memStore(t)}
	addr, _ := serve(t, spy, server.Config{TLS: tlsCfg, Access: src})
	conn := dial(t, addr, ca.clientTLS(nil))
	c := idemregv1.NewRegistryServiceClient(conn)
	with := func(header string) context.Context {
		return metadata.AppendToOutgoingContext(t.Context(), "authorization", header)
	}
	claim := func(ctx context.Context, consumer string) error {
		_, err := c.Claim(ctx, &idemregv1.ClaimRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
		return err
	}

	require.NoError(t, claim(with("Bearer "+billingToken), "billing.worker"))
	require.NoError(t, claim(with("bearer "+billingToken), "billing.refunds"), "a prefix grant; the scheme is case-insensitive")
	require.NoError(t, claim(with("Bearer "+ordersToken), "orders.inbox"))
	before := spy.calls.Load()
	requireStatus(t, claim(with("Bearer "+ordersToken), "billing.worker"), codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	requireStatus(t, claim(with("Bearer "+billingToken), "orders.inbox"), codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	requireStatus(t, claim(t.Context(), "orders.inbox"), codes.Unauthenticated, idemregv1.ReasonUnauthenticated)
	requireStatus(t, claim(with("Bearer wrong-token"), "orders.inbox"), codes.Unauthenticated, idemregv1.ReasonUnauthenticated)
	requireStatus(t, claim(with("Bearer "+access.HashToken(ordersToken)), "orders.inbox"), codes.Unauthenticated, idemregv1.ReasonUnauthenticated)
	requireStatus(t, claim(with("Basic b3JkZXJzOng="), "orders.inbox"), codes.Unauthenticated, idemregv1.ReasonUnauthenticated)
	_, err = idemregv1.NewAdminServiceClient(conn).InspectRecord(with("Bearer "+billingToken),
		&idemregv1.InspectRecordRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
	requireStatus(t, err, codes.PermissionDenied, idemregv1.ReasonPermissionDenied)
	require.Equal(t, before, spy.calls.Load(), "no refused call reached the store")

	// Health and reflection need no credentials.
	hc := healthpb.NewHealthClient(conn)
	require.Eventually(t, func() bool {
		res, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{})
		return err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 5*time.Second, 10*time.Millisecond)
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
	_, err = stream.Recv()
	require.NoError(t, err)
}

func statusCode(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	type grpcStatus interface{ GRPCStatus() *status.Status }
	if s, ok := err.(grpcStatus); ok {
		return s.GRPCStatus().Code()
	}
	return codes.Unknown
}
