package client_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The downstream is a real gRPC service registered by hand, without a proto
// of its own: Charge takes and returns a StringValue; Watch streams three.
const (
	downstreamService = "idemreg.clienttest.Payments"
	chargeMethod      = "/" + downstreamService + "/Charge"
	refundMethod      = "/" + downstreamService + "/Refund"
	watchMethod       = "/" + downstreamService + "/Watch"
)

type paymentsServer interface {
	charge(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)
}

func unaryHandler(method string) func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
	return func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		in := new(wrapperspb.StringValue)
		if err := dec(in); err != nil {
			return nil, err
		}
		call := func(ctx context.Context, req any) (any, error) {
			return srv.(paymentsServer).charge(ctx, req.(*wrapperspb.StringValue))
		}
		if interceptor == nil {
			return call(ctx, in)
		}
		return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: method}, call)
	}
}

var paymentsDesc = grpc.ServiceDesc{
	ServiceName: downstreamService,
	HandlerType: (*paymentsServer)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Charge", Handler: unaryHandler(chargeMethod)},
		{MethodName: "Refund", Handler: unaryHandler(refundMethod)},
	},
	Streams: []grpc.StreamDesc{{
		StreamName:    "Watch",
		ServerStreams: true,
		Handler: func(srv any, stream grpc.ServerStream) error {
			srv.(*downstream).streams.Add(1)
			in := new(wrapperspb.StringValue)
			if err := stream.RecvMsg(in); err != nil {
				return err
			}
			for i := range 3 {
				if err := stream.SendMsg(wrapperspb.String(in.GetValue() + string(rune('0'+i)))); err != nil {
					return err
				}
			}
			return nil
		},
	}},
}

// downstream counts executions and records the idempotency keys it saw.
// Its answer is "charged:" + the request unless respond is set.
type downstream struct {
	calls   atomic.Int64
	streams atomic.Int64 // Watch calls run
	mu      sync.Mutex
	keys    []string
	respond func(ctx context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)
}

func (d *downstream) charge(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	n := d.calls.Add(1)
	d.mu.Lock()
	d.keys = append(d.keys, metadata.ValueFromIncomingContext(ctx, "idempotency-key")...)
	respond := d.respond
	d.mu.Unlock()
	if respond != nil {
		return respond(ctx, n, req)
	}
	return wrapperspb.String("charged:" + req.GetValue()), nil
}

func (d *downstream) setRespond(f func(ctx context.Context, n int64, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.respond = f
}

func (d *downstream) seenKeys() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.keys...)
}

// startDownstream serves a downstream on a loopback listener.
func startDownstream(t *testing.T, opts ...grpc.ServerOption) (string, *downstream) {
	t.Helper()
	d := &downstream{}
	srv := grpc.NewServer(opts...)
	srv.RegisterService(&paymentsDesc, d)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String(), d
}

func dial(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func charge(ctx context.Context, conn *grpc.ClientConn, v string, opts ...grpc.CallOption) (*wrapperspb.StringValue, error) {
	out := new(wrapperspb.StringValue)
	err := conn.Invoke(ctx, chargeMethod, wrapperspb.String(v), out, opts...)
	return out, err
}

// watch runs the streaming method and returns what it streamed.
func watch(ctx context.Context, conn *grpc.ClientConn, v string) ([]string, error) {
	stream, err := conn.NewStream(ctx, &paymentsDesc.Streams[0], watchMethod)
	if err != nil {
		return nil, err
	}
	if err := stream.SendMsg(wrapperspb.String(v)); err != nil {
		return nil, err
	}
	if err := stream.CloseSend(); err != nil {
		return nil, err
	}
	var got []string
	for {
		m := new(wrapperspb.StringValue)
		if err := stream.RecvMsg(m); err != nil {
			if errors.Is(err, io.EOF) {
				return got, nil
			}
			return got, err
		}
		got = append(got, m.GetValue())
	}
}
