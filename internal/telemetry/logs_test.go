package telemetry

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
)

func lines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(buf.String()) {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), "%s", line)
		out = append(out, m)
	}
	return out
}

// TestLogDurations: a duration is written as Go writes it, in JSON and in
// text, in a line's fields, the logger's and a group's.
func TestLogDurations(t *testing.T) {
	var buf bytes.Buffer
	NewLogger(&buf, "json", slog.LevelInfo).With("sweep_interval", time.Minute).
		Info("sweeper on", "timeout", 10*time.Second, slog.Group("batch", "pause", 50*time.Millisecond), "n", 3)
	l := lines(t, &buf)
	require.Len(t, l, 1)
	require.Equal(t, "1m0s", l[0]["sweep_interval"])
	require.Equal(t, "10s", l[0]["timeout"])
	require.Equal(t, map[string]any{"pause": "50ms"}, l[0]["batch"])
	require.EqualValues(t, 3, l[0]["n"], "other numbers stay numbers")

	buf.Reset()
	NewLogger(&buf, "text", slog.LevelInfo).Info("draining", "timeout", 90*time.Second)
	require.Contains(t, buf.String(), "timeout=1m30s")
}

// TestLogTraceIDs: a line written with the context of a span carries its
// trace and span; one without a span carries neither.
func TestLogTraceIDs(t *testing.T) {
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
	})
	traced := trace.ContextWithSpanContext(context.Background(), sc)
	for _, format := range []string{"json", "text"} {
		t.Run(format, func(t *testing.T) {
			var buf bytes.Buffer
			logger := NewLogger(&buf, format, slog.LevelInfo).With("component", "server")
			logger.InfoContext(traced, "finished call", "grpc.code", "OK")
			logger.InfoContext(context.Background(), "serving")
			logger.Info("stopped")
			out := strings.Split(strings.TrimSpace(buf.String()), "\n")
			require.Len(t, out, 3)
			require.Contains(t, out[0], "4bf92f3577b34da6a3ce929d0e0e4736")
			require.Contains(t, out[0], "00f067aa0ba902b7")
			for _, line := range out[1:] {
				require.NotContains(t, line, "trace_id")
				require.NotContains(t, line, "span_id")
			}
			if format == "json" {
				l := lines(t, &buf)
				require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", l[0]["trace_id"])
				require.Equal(t, "00f067aa0ba902b7", l[0]["span_id"])
				require.Equal(t, "server", l[0]["component"])
			}
		})
	}
}

// TestLogLevel: the level is the handler's.
func TestLogLevel(t *testing.T) {
	var buf bytes.Buffer
	logger := NewLogger(&buf, "json", slog.LevelWarn)
	logger.Info("quiet")
	logger.Warn("loud")
	require.Len(t, lines(t, &buf), 1)
}
