package client_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestImports keeps package client light: a service that adds the
// interceptor must not pull in the registry's server, its storage or a
// database driver. It lists the package's dependencies with the go command.
func TestImports(t *testing.T) {
	goList := func(format string) []string { return goList(t, format, ".") }

	// Direct imports: the standard library, gRPC, protobuf, the genproto
	// error details and our generated API, nothing else.
	allowedDirect := []string{
		"google.golang.org/grpc",
		"google.golang.org/protobuf/",
		"google.golang.org/genproto/googleapis/rpc/",
		"github.com/idemreg/idemreg/proto/",
	}
	imports := goList(`{{join .Imports " "}}`)
	require.NotEmpty(t, imports)
	for _, imp := range imports {
		if !strings.Contains(strings.SplitN(imp, "/", 2)[0], ".") {
			continue // standard library
		}
		ok := false
		for _, prefix := range allowedDirect {
			ok = ok || strings.HasPrefix(imp, prefix)
		}
		require.True(t, ok, "package client imports %s; it may import only gRPC, protobuf, genproto errdetails and the generated API", imp)
	}

	// Transitive dependencies: none of the registry's own packages besides
	// the generated API, and no storage engine or driver.
	forbidden := []string{
		"github.com/idemreg/idemreg/server",
		"github.com/idemreg/idemreg/storage",
		"github.com/idemreg/idemreg/cmd",
		"github.com/jackc/",
		"github.com/cockroachdb/",
		"github.com/lib/pq",
		"github.com/nats-io/",
		"database/sql",
	}
	deps := goList(`{{join .Deps " "}}`)
	require.Contains(t, deps, "google.golang.org/grpc", "the dependency list looks wrong")
	for _, dep := range deps {
		for _, f := range forbidden {
			require.False(t, dep == f || strings.HasPrefix(dep, f+"/") || strings.HasPrefix(dep, f) && strings.HasSuffix(f, "/"),
				"package client depends on %s", dep)
		}
	}
}

// TestFenceImports keeps client/fence on the standard library alone: it
// runs inside the caller's database transaction with whatever driver the
// caller chose, so it must not bring one (or gRPC) of its own.
func TestFenceImports(t *testing.T) {
	deps := goList(t, `{{join .Deps " "}}`, "./fence")
	require.Contains(t, deps, "database/sql", "the dependency list looks wrong")
	for _, dep := range deps {
		require.False(t, strings.Contains(strings.SplitN(dep, "/", 2)[0], "."),
			"package client/fence depends on %s; it may use only the standard library", dep)
	}
}

func goList(t *testing.T, format, pkg string) []string {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "go", "list", "-f", format, pkg).CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	return strings.Fields(string(out))
}

// TestInterceptorReasonsAreTheirOwn: the reasons only the interceptors
// answer with never collide with a registry reason (declared once, in the
// API package), so that a caller can tell who refused.
func TestInterceptorReasonsAreTheirOwn(t *testing.T) {
	for _, own := range []string{client.ReasonInProgress, client.ReasonMissingKey, client.ReasonRegistryUnavailable} {
		require.NotContains(t, idemregv1.Reasons, own)
	}
}
