package idemregv1_test

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestReasonsAreDocumented: the reason table at the top of registry.proto
// lists exactly the reasons declared in reasons.go.
func TestReasonsAreDocumented(t *testing.T) {
	src, err := os.ReadFile("registry.proto")
	if err != nil {
		t.Fatal(err)
	}
	head, _, ok := strings.Cut(string(src), "\npackage ")
	if !ok {
		t.Fatal("registry.proto has no package line")
	}
	row := regexp.MustCompile(`(?m)^//\s+([A-Z][A-Z_]+)\s{2,}[A-Z_]+\s{2,}\S`)
	var documented []string
	for _, m := range row.FindAllStringSubmatch(head, -1) {
		if m[1] != "reason" {
			documented = append(documented, m[1])
		}
	}
	declared := slices.Clone(idemregv1.Reasons)
	slices.Sort(documented)
	slices.Sort(declared)
	if !slices.Equal(documented, declared) {
		t.Fatalf("registry.proto documents %v\nreasons.go declares %v", documented, declared)
	}
}
