package faults

import (
	"testing"

	"github.com/idemreg/idemreg/internal/servetest"
)

func TestMain(m *testing.M) { servetest.Main(m) }
