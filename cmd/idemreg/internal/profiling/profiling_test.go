package profiling

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCmdlineRedacted: /debug/pprof/cmdline answers as pprof's own does,
// the arguments separated by NUL bytes, with no password in them.
func TestCmdlineRedacted(t *testing.T) {
	args := []string{"idemreg", "serve", "--database-url", "postgres://u:S3cretPw@db/idemreg", "--database-url=host=db password=S3cretPw"}
	rec := httptest.NewRecorder()
	redactedCmdline(args)(rec, httptest.NewRequest("GET", "/debug/pprof/cmdline", nil))
	body, err := io.ReadAll(rec.Result().Body)
	require.NoError(t, err)
	require.NotContains(t, string(body), "S3cretPw")
	got := strings.Split(string(body), "\x00")
	require.Len(t, got, len(args))
	require.Equal(t, args[:3], got[:3])
	require.Equal(t, "nosniff", rec.Header().Get("X-Content-Type-Options"))
}
