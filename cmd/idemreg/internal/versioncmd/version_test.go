package versioncmd

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestText: version prints the toolchain's record, "+modified" for a
// changed tree, "unknown" where there is none, and make build's stamp over
// any of it.
func TestText(t *testing.T) {
	stamped := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261202085110-8f54bb24c0bb"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "8f54bb24c0bb819ab5b049de82bfeba8460123a2"},
			{Key: "vcs.time", Value: "2026-12-02T08:51:10Z"}, {Key: "vcs.modified", Value: "true"}, {Key: "CGO_ENABLED", Value: "0"}}}
	require.Equal(t, `idemreg v0.0.0-20261202085110-8f54bb24c0bb
revision: 8f54bb24c0bb819ab5b049de82bfeba8460123a2+modified
time:     2026-12-02T08:51:10Z
go:       go1.26.8
`, Text(stamped, Stamp{}))
	require.Contains(t, Text(&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, Stamp{}), "revision: unknown\n")

	// make build's -ldflags -X stamp wins over the toolchain's (the image
	// is built without .git, and a checkout may build with -buildvcs=false).
	require.Equal(t, `idemreg v1.4.0-3-g0123abc-dirty
revision: 0123abcdef0123abcdef0123abcdef0123abcdef
time:     2026-12-03T10:00:00Z
go:       go1.26.8
`, Text(stamped, Stamp{"v1.4.0-3-g0123abc-dirty", "0123abcdef0123abcdef0123abcdef0123abcdef", "2026-12-03T10:00:00Z"}))
	require.Equal(t, `idemreg (devel)
revision: 0123abcdef0123abcdef0123abcdef0123abcdef
time:     unknown
go:       go1.26.8
`, Text(&debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}}, Stamp{Revision: "0123abcdef0123abcdef0123abcdef0123abcdef"}))
}

// TestServed: what make build stamps (-ldflags -X) is what
// idemreg_build_info and the startup line name; the toolchain's otherwise.
func TestServed(t *testing.T) {
	require.Equal(t, runtime.Version(), Served(Stamp{}).GoVersion)
	b := Served(Stamp{Version: "v1.4.0", Revision: "0123abcd"})
	require.Equal(t, "v1.4.0", b.Version)
	require.Equal(t, "0123abcd", b.Revision)
	require.Equal(t, runtime.Version(), b.GoVersion)
}
