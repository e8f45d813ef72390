package main

import (
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/internal/servetest"
)

// TestServeHealthzReadyz: serve answers GET /healthz and /readyz on its
// metrics listener (for probes that do not speak gRPC health), as its
// gRPC health service answers: 200 while serving, 404 for a service it
// does not know. The handler's own cases (a store down, a slow check)
// are httpserve's TestHealthChecks; this test holds serve to wiring it.
func TestServeHealthzReadyz(t *testing.T) {
	bin := servetest.Binary(t)
	metricsAddr := servetest.FreeAddr(t)
	p := servetest.Start(t, bin, t.TempDir(), nil, "--metrics-listen", metricsAddr)
	p.WaitLog(t, "serving")
	get := func(path string) (int, string) {
		res, err := http.Get("http://" + metricsAddr + path)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(b)
	}
	for _, path := range []string{"/healthz", "/readyz", "/readyz?service=idemreg.v1.RegistryService"} {
		code, body := get(path)
		require.Equal(t, http.StatusOK, code, "%s: %s", path, body)
	}
	code, body := get("/readyz?service=no.such.Service")
	require.Equal(t, http.StatusNotFound, code, body)
	code, _ = get("/metrics")
	require.Equal(t, http.StatusOK, code, "/metrics still served beside them")
}
