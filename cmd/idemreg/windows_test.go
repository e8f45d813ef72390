package main

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"

	"github.com/idemreg/idemreg/internal/servetest"
	"github.com/idemreg/idemreg/server"
)

// TestServeStaticWindows: serve fixes its HTTP/2 windows by default
// (server.DefaultStaticWindow), which its SETTINGS advertise as the
// initial stream window, and --static-window 0 leaves grpc-go's dynamic
// ones, which start at HTTP/2's 65,535 bytes and grow by the PINGs that
// static windows spare (issue 36).
func TestServeStaticWindows(t *testing.T) {
	bin := servetest.Binary(t)
	for _, tc := range []struct {
		name string
		args []string
		want uint32
	}{
		{"default", nil, server.DefaultStaticWindow},
		{"set", []string{"--static-window", "262144"}, 262144},
		{"dynamic", []string{"--static-window", "0"}, 65535},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := servetest.Start(t, bin, t.TempDir(), nil, append([]string{"--data-dir", t.TempDir()}, tc.args...)...)
			p.WaitLog(t, "serving")
			conn, err := net.Dial("tcp", p.Addr)
			require.NoError(t, err)
			defer conn.Close()
			require.NoError(t, conn.SetDeadline(time.Now().Add(20*time.Second)))
			_, err = io.WriteString(conn, http2Preface)
			require.NoError(t, err)
			fr := http2.NewFramer(conn, conn)
			require.NoError(t, fr.WriteSettings())
			f, err := fr.ReadFrame()
			require.NoError(t, err)
			settings, ok := f.(*http2.SettingsFrame)
			require.True(t, ok, "the server's first frame is %T", f)
			window, ok := settings.Value(http2.SettingInitialWindowSize)
			if !ok {
				window = 65535 // HTTP/2's initial window, not advertised
			}
			require.Equal(t, tc.want, window)
		})
	}
}
