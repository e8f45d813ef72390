package storechain

import (
	"testing"

	"github.com/stretchr/testify/require"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestErrorTypesStartAtZero: every error.type that ErrorType can give is
// one that zero starts idemreg.store.errors at.
func TestErrorTypesStartAtZero(t *testing.T) {
	for r := range idemregv1.ErrorReason_name {
		require.Contains(t, errorTypes, ErrorType(idemregv1.ErrorReason(r)))
	}
}
