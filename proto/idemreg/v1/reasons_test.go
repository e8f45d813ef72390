package idemregv1_test

import (
	"slices"
	"strings"
	"testing"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestReasonsAreTheEnum: reasons.go declares exactly the names of
// ErrorReason's values without their prefix.
func TestReasonsAreTheEnum(t *testing.T) {
	var enum []string
	for n, name := range idemregv1.ErrorReason_name {
		if n != 0 {
			enum = append(enum, strings.TrimPrefix(name, "ERROR_REASON_"))
		}
	}
	declared := slices.Clone(idemregv1.Reasons)
	slices.Sort(enum)
	slices.Sort(declared)
	if !slices.Equal(enum, declared) {
		t.Fatalf("error_reason.proto has %v\nreasons.go declares %v", enum, declared)
	}
}
