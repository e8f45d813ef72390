package server_test

import (
	"context"
	"crypto/x509/pkix"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// TestInProcessActAs: on the InProcess connection (the console's) a call
// is made as the identity ActAs names, whatever that identity
// authenticates by elsewhere, and with TLS and mTLS on; on a network
// connection the name authenticates nothing.
func TestInProcessActAs(t *testing.T) {
	ca := newPKI(t, "test CA")
	srvCert := ca.issue("server", true, nil, nil, pkix.Name{CommonName: "idemreg"})
	billingCert := ca.issue("billing", false, []string{"spiffe://test.example/billing"}, nil, pkix.Name{CommonName: "billing"})
	tlsCfg, err := server.TLSConfig(server.TLSFiles{CertFile: srvCert.certFile, KeyFile: srvCert.keyFile, ClientCAFile: ca.caFile()}, nil)
	require.NoError(t, err)
	set := accessFile(t, `
identities:
  - name: billing
    uris: ["spiffe://test.example/billing"]
    consumers: ["billing.*"]
    admin: ["billing.*"]
  - name: shipping
    uris: ["spiffe://test.example/shipping"]
    consumers: ["shipping.*"]
    admin: ["shipping.*"]
`)
	addr, srv := serve(t, memStore(t), server.Config{TLS: tlsCfg, Access: set})
	in, err := srv.InProcess()
	require.NoError(t, err)
	t.Cleanup(func() { _ = in.Close() })

	// A record claimed by billing over mTLS.
	_, err = idemregv1.NewRegistryServiceClient(dial(t, addr, ca.clientTLS(&billingCert))).Claim(t.Context(),
		&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k"})
	require.NoError(t, err)
	inspect := func(ctx context.Context, conn grpc.ClientConnInterface) error {
		_, err := idemregv1.NewAdminServiceClient(conn).InspectRecord(ctx,
			&idemregv1.InspectRecordRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_OPERATION, Key: "k"})
		return err
	}
	require.NoError(t, inspect(server.ActAs(t.Context(), "billing"), in), "in process, as billing, without its certificate")
	require.Equal(t, codes.PermissionDenied, statusCode(inspect(server.ActAs(t.Context(), "shipping"), in)), "as shipping: its grants decide")
	require.Equal(t, codes.Unauthenticated, statusCode(inspect(server.ActAs(t.Context(), "nobody"), in)), "no such identity")
	require.Equal(t, codes.Unauthenticated, statusCode(inspect(t.Context(), in)), "in process, a call naming no identity has none")
	twice := metadata.AppendToOutgoingContext(server.ActAs(t.Context(), "shipping"), "idemreg-act-as", "billing")
	require.Equal(t, codes.Unauthenticated, statusCode(inspect(twice, in)), "two names are refused, not the first taken")

	// Over the network, with a client certificate that names no identity
	// of the file, the name is ignored.
	stranger := ca.issue("stranger", false, []string{"spiffe://test.example/stranger"}, nil, pkix.Name{CommonName: "stranger"})
	err = inspect(server.ActAs(t.Context(), "billing"), dial(t, addr, ca.clientTLS(&stranger)))
	require.Equal(t, codes.Unauthenticated, statusCode(err), "%v", err)

	// Closed, it carries no more calls (and its listener is closed, ending
	// its Serve).
	require.NoError(t, in.Close())
	require.Equal(t, codes.Canceled, statusCode(inspect(server.ActAs(t.Context(), "billing"), in)))
}
