package client_test

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/credentials/local"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
)

const testToken = "idemreg_s3cr3t-t0ken"

// headerServer stands in for the registry: it answers every call NOT_FOUND
// and records the authorization header each call carried ("" for none).
// The registry's own check of the header is tested in tests/client.
type headerServer struct {
	mu   sync.Mutex
	seen []string
}

func (h *headerServer) calls() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.seen...)
}

// serveHeaders serves a headerServer on lis until the test ends.
func serveHeaders(t *testing.T, lis net.Listener, opts ...grpc.ServerOption) *headerServer {
	t.Helper()
	h := &headerServer{}
	srv := grpc.NewServer(append(opts, grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		md, _ := metadata.FromIncomingContext(stream.Context())
		h.mu.Lock()
		h.seen = append(h.seen, strings.Join(md.Get("authorization"), ","))
		h.mu.Unlock()
		return status.Error(codes.NotFound, "no record")
	}))...)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return h
}

func listenTCP(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}

// lookup makes one registry call through the typed client on a new
// connection to target.
func lookup(t *testing.T, target string, opts ...grpc.DialOption) error {
	t.Helper()
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	defer conn.Close()
	_, err = client.New(conn).Lookup(t.Context(), client.Key{Consumer: "billing.payments", Kind: client.KindOperation, Key: "k-1"})
	return err
}

// TestBearerTokenSent: over a connection with privacy and integrity (gRPC's
// local credentials on a Unix socket) BearerToken sends the header the
// registry reads, on every call.
func TestBearerTokenSent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "registry.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	h := serveHeaders(t, lis, grpc.Creds(local.NewCredentials()))
	creds := client.BearerToken(testToken)
	if !creds.RequireTransportSecurity() {
		t.Error("BearerToken: RequireTransportSecurity() = false, want true")
	}

	for range 2 {
		if err := lookup(t, "unix://"+sock, grpc.WithTransportCredentials(local.NewCredentials()), grpc.WithPerRPCCredentials(creds)); status.Code(err) != codes.NotFound {
			t.Fatalf("Lookup: %v; want the stand-in's NOT_FOUND", err)
		}
	}
	want := []string{"Bearer " + testToken, "Bearer " + testToken}
	if got := h.calls(); !slices.Equal(got, want) {
		t.Errorf("authorization headers received = %q, want %q", got, want)
	}
}

// TestBearerTokenNeedsProtection: BearerToken never sends the token over a
// connection that does not encrypt it. With plaintext transport
// credentials grpc.NewClient refuses it; with local credentials over TCP
// (not plaintext to gRPC, but no security either) the connection fails
// before the call is sent. InsecureBearerToken sends it on both.
func TestBearerTokenNeedsProtection(t *testing.T) {
	t.Run("plaintext", func(t *testing.T) {
		lis := listenTCP(t)
		h := serveHeaders(t, lis)
		_, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithPerRPCCredentials(client.BearerToken(testToken)))
		if err == nil {
			t.Fatal("grpc.NewClient accepted BearerToken with plaintext transport credentials")
		}
		if strings.Contains(err.Error(), testToken) {
			t.Errorf("the error quotes the token: %v", err)
		}

		creds := client.InsecureBearerToken(testToken)
		if creds.RequireTransportSecurity() {
			t.Error("InsecureBearerToken: RequireTransportSecurity() = true, want false")
		}
		if err := lookup(t, lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(creds)); status.Code(err) != codes.NotFound {
			t.Fatalf("Lookup with InsecureBearerToken: %v; want the stand-in's NOT_FOUND", err)
		}
		if got, want := h.calls(), []string{"Bearer " + testToken}; !slices.Equal(got, want) {
			t.Errorf("authorization headers received = %q, want %q", got, want)
		}
	})

	t.Run("local credentials over TCP", func(t *testing.T) {
		lis := listenTCP(t)
		h := serveHeaders(t, lis, grpc.Creds(local.NewCredentials()))
		err := lookup(t, lis.Addr().String(), grpc.WithTransportCredentials(local.NewCredentials()),
			grpc.WithPerRPCCredentials(client.BearerToken(testToken)))
		if !errors.Is(err, client.ErrUnavailable) || !strings.Contains(err.Error(), "insecure connection") {
			t.Fatalf("Lookup: %v; want gRPC's refusal to send secure credentials on an insecure connection", err)
		}
		if strings.Contains(err.Error(), testToken) {
			t.Errorf("the error quotes the token: %v", err)
		}
		if got := h.calls(); len(got) != 0 {
			t.Fatalf("the call reached the server with %q", got)
		}

		err = lookup(t, lis.Addr().String(), grpc.WithTransportCredentials(local.NewCredentials()),
			grpc.WithPerRPCCredentials(client.InsecureBearerToken(testToken)))
		if status.Code(err) != codes.NotFound {
			t.Fatalf("Lookup with InsecureBearerToken: %v; want the stand-in's NOT_FOUND", err)
		}
		if got, want := h.calls(), []string{"Bearer " + testToken}; !slices.Equal(got, want) {
			t.Errorf("authorization headers received = %q, want %q", got, want)
		}
	})
}

// TestBearerTokenRefused: a token that cannot be sent as it is fails every
// call with ErrUnauthenticated, without reaching the server, and the error
// does not quote it.
func TestBearerTokenRefused(t *testing.T) {
	lis := listenTCP(t)
	h := serveHeaders(t, lis)
	tests := []struct {
		name, token string
	}{
		{name: "empty", token: ""},
		{name: "trailing newline", token: testToken + "\n"},
		{name: "space", token: "idemreg_ s3cr3t"},
		{name: "non-ASCII", token: "idemreg_s3cr3t\u00e9"},
		{name: "control byte", token: "idemreg_\x7fs3cr3t"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := lookup(t, lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithPerRPCCredentials(client.InsecureBearerToken(tt.token)))
			if !errors.Is(err, client.ErrUnauthenticated) || status.Code(err) != codes.Unauthenticated {
				t.Fatalf("Lookup: %v; want ErrUnauthenticated, UNAUTHENTICATED", err)
			}
			if tt.token != "" && strings.Contains(err.Error(), strings.TrimSpace(tt.token)) {
				t.Errorf("the error quotes the token: %v", err)
			}
		})
	}
	if got := h.calls(); len(got) != 0 {
		t.Errorf("refused tokens reached the server: %q", got)
	}
}

// TestBearerTokenRedacted: however the credentials are printed, the token
// is not.
func TestBearerTokenRedacted(t *testing.T) {
	for _, creds := range []credentials.PerRPCCredentials{client.BearerToken(testToken), client.InsecureBearerToken(testToken)} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x"} {
			if got := fmt.Sprintf(verb, creds); strings.Contains(got, testToken) || !strings.Contains(got, "redacted") {
				t.Errorf("Sprintf(%q) = %s; want it redacted", verb, got)
			}
		}
	}
}
