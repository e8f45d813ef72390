package storage_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/idemreg/idemreg/storage"
)

func TestCheckConsumer(t *testing.T) {
	for _, ok := range []string{"", "billing.worker", "a:b/c-d_e.F9", strings.Repeat("x", storage.MaxConsumerBytes)} {
		assert.NoError(t, storage.CheckConsumer(ok), "%q", ok)
	}
	for bad, says := range map[string]string{
		"bill ing": `found ' ' at byte 4`,
		"é":        "at byte 0",
		"a*":       `found '*' at byte 1`,
		"nul\x00":  `found '\x00' at byte 3`,
		strings.Repeat("x", storage.MaxConsumerBytes+1): "at most 128 bytes, got 129",
	} {
		err := storage.CheckConsumer(bad)
		if assert.Error(t, err, "%q", bad) {
			assert.Contains(t, err.Error(), says)
		}
	}
}
