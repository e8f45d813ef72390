package server

import (
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// lineHandler hands each record to a channel.
type lineHandler struct{ lines chan slog.Record }

func (h lineHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h lineHandler) Handle(_ context.Context, r slog.Record) error {
	h.lines <- r
	return nil
}
func (h lineHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h lineHandler) WithGroup(string) slog.Handler      { return h }

// TestAccessLogCodeIsTheWires: a handler whose response does not encode
// returns a success to every interceptor, and gRPC answers INTERNAL after
// them; the access log line says INTERNAL, what the caller got, not the
// OK the interceptors saw (issue 25: an answer whose batch item did not
// encode was logged OK).
func TestAccessLogCodeIsTheWires(t *testing.T) {
	h := lineHandler{lines: make(chan slog.Record, 4)}
	a := accessLogger{logger: slog.New(h)}
	g := grpc.NewServer(grpc.StatsHandler(a), grpc.UnaryInterceptor(a.unary))
	g.RegisterService(&grpc.ServiceDesc{
		ServiceName: "test.Broken",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Get", Handler: func(_ any, ctx context.Context, dec func(any) error, in grpc.UnaryServerInterceptor) (any, error) {
			var req emptypb.Empty
			if err := dec(&req); err != nil {
				return nil, err
			}
			return in(ctx, &req, &grpc.UnaryServerInfo{FullMethod: "/test.Broken/Get"}, func(context.Context, any) (any, error) {
				return &spb.Status{Message: "\xff"}, nil // protobuf refuses to encode it
			})
		}}},
	}, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	err = conn.Invoke(t.Context(), "/test.Broken/Get", &emptypb.Empty{}, &spb.Status{})
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	line := <-h.lines
	require.Equal(t, "finished call", line.Message)
	got := map[string]string{}
	line.Attrs(func(a slog.Attr) bool { got[a.Key] = a.Value.String(); return true })
	require.Equal(t, "INTERNAL", got["grpc.code"], "%v", got)
	require.Equal(t, "Get", got["grpc.method"])
	require.Equal(t, slog.LevelError, line.Level)
}

// TestRefusalSampler: at most perSecond lines a second per identity and
// code; the next line written says how many were left out; other keys and
// the next second are not affected.
func TestRefusalSampler(t *testing.T) {
	s := newRefusalSampler(2)
	t0 := time.Unix(100, 0)
	admit := func(at time.Time, id string, c codes.Code) (bool, int64) { return s.admit(at, id, c) }
	for i := range 2 {
		ok, out := admit(t0, "team", codes.PermissionDenied)
		require.True(t, ok, "line %d", i)
		require.Zero(t, out)
	}
	for range 5 {
		ok, _ := admit(t0.Add(500*time.Millisecond), "team", codes.PermissionDenied)
		require.False(t, ok)
	}
	ok, _ := admit(t0, "other", codes.PermissionDenied)
	require.True(t, ok, "another identity has its own")
	ok, _ = admit(t0, "team", codes.Unauthenticated)
	require.True(t, ok, "another code has its own")
	ok, out := admit(t0.Add(time.Second), "team", codes.PermissionDenied)
	require.True(t, ok, "the next second")
	require.Equal(t, int64(5), out, "the lines left out before it")
	ok, out = admit(t0.Add(time.Second), "team", codes.PermissionDenied)
	require.True(t, ok)
	require.Zero(t, out)
}
