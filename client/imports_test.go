package client_test

// The client's own tests use the standard library's testing alone: its
// module requires gRPC, protobuf, genproto and the API, and a test library
// there would join the module graph of every service that imports it. Tests
// that want testify or a running registry live in the tests module
// (tests/client).

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

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
	if len(imports) == 0 {
		t.Fatal("go list listed no imports")
	}
	for _, imp := range imports {
		if !strings.Contains(strings.SplitN(imp, "/", 2)[0], ".") {
			continue // standard library
		}
		ok := false
		for _, prefix := range allowedDirect {
			ok = ok || strings.HasPrefix(imp, prefix)
		}
		if !ok {
			t.Errorf("package client imports %s; it may import only gRPC, protobuf, genproto errdetails and the generated API", imp)
		}
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
	if !slices.Contains(deps, "google.golang.org/grpc") {
		t.Fatalf("the dependency list looks wrong: %v", deps)
	}
	for _, dep := range deps {
		for _, f := range forbidden {
			if dep == f || strings.HasPrefix(dep, f+"/") || strings.HasPrefix(dep, f) && strings.HasSuffix(f, "/") {
				t.Errorf("package client depends on %s", dep)
			}
		}
	}
}

// TestFenceImports keeps client/fence on the standard library alone: it
// runs inside the caller's database transaction with whatever driver the
// caller chose, so it must not bring one (or gRPC) of its own.
func TestFenceImports(t *testing.T) {
	deps := goList(t, `{{join .Deps " "}}`, "./fence")
	if !slices.Contains(deps, "database/sql") {
		t.Fatalf("the dependency list looks wrong: %v", deps)
	}
	for _, dep := range deps {
		if strings.Contains(strings.SplitN(dep, "/", 2)[0], ".") {
			t.Errorf("package client/fence depends on %s; it may use only the standard library", dep)
		}
	}
}

func goList(t *testing.T, format, pkg string) []string {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "go", "list", "-f", format, pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v: %s", err, out)
	}
	return strings.Fields(string(out))
}

// TestInterceptorReasonsAreTheirOwn: the reasons only the interceptors
// answer with never collide with a registry reason (declared once, in the
// API package), so that a caller can tell who refused.
func TestInterceptorReasonsAreTheirOwn(t *testing.T) {
	for _, own := range []string{client.ReasonInProgress, client.ReasonMissingKey, client.ReasonRegistryUnavailable} {
		if slices.Contains(idemregv1.Reasons, own) {
			t.Errorf("the interceptors' reason %s is also a registry reason", own)
		}
	}
}
