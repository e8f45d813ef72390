package client

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Streaming calls are not de-duplicated: a stream's outcome is a sequence
// of messages interleaved with the caller's, which the registry cannot
// replay faithfully within a result's bound, and a half-sent stream has no
// single outcome to store. What the client guarantees instead is that no
// keyed call runs twice without saying so:
//
//   - UnaryClientInterceptor and UnaryServerInterceptor refuse, when they
//     are built, a WithMethods list that names a streaming method, since a
//     unary interceptor never sees it (the generated code registers every
//     method's descriptor, which is how they tell);
//   - StreamServerInterceptor and StreamClientInterceptor refuse a keyed
//     streaming call (ErrKeyUnsupported) without running it;
//   - a unary interceptor whose client has no stream interceptor logs an
//     error once per service that has streaming methods, naming them.

// methodKind is "server-streaming", "client-streaming" or "bidi-streaming"
// for a streaming method whose descriptor is linked into the binary, and
// "" for a unary or unknown one.
func methodKind(fullMethod string) string {
	svc, name, ok := splitMethod(fullMethod)
	if !ok {
		return ""
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return ""
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return ""
	}
	md := sd.Methods().ByName(protoreflect.Name(name))
	if md == nil {
		return ""
	}
	return streamKind(md.IsStreamingClient(), md.IsStreamingServer())
}

func streamKind(client, server bool) string {
	switch {
	case client && server:
		return "bidi-streaming"
	case client:
		return "client-streaming"
	case server:
		return "server-streaming"
	}
	return ""
}

// splitMethod splits "/pkg.Service/Method".
func splitMethod(fullMethod string) (service, method string, ok bool) {
	m := strings.TrimPrefix(fullMethod, "/")
	i := strings.LastIndexByte(m, '/')
	if i <= 0 || i == len(m)-1 {
		return "", "", false
	}
	return m[:i], m[i+1:], true
}

// mustBeUnary panics, naming the method, when s selects a streaming method
// by name: the configuration promises what a unary interceptor cannot
// keep, and a service should not start with it.
func mustBeUnary(entry string, s *settings) {
	for _, m := range s.methods {
		if kind := methodKind(m); kind != "" {
			panic(fmt.Sprintf("idemreg: client.%s: WithMethods names %s, a %s method: a unary interceptor never sees it, "+
				"so its keyed calls would run every time. Streams are not de-duplicated: remove it from WithMethods, "+
				"and install client.Stream%s to refuse keyed calls to it", entry, m, kind, strings.Replace(entry, "Unary", "", 1)))
		}
	}
}

// streamWarnings logs, once per service, that the service has streaming
// methods that a unary interceptor cannot guard, when no stream interceptor
// of the same client is installed.
type streamWarnings struct{ seen sync.Map }

func (w *streamWarnings) check(ctx context.Context, c *Client, s *settings, entry, fullMethod string) {
	if c.streamGuard.Load() {
		return
	}
	svc, _, ok := splitMethod(fullMethod)
	if !ok {
		return
	}
	if _, done := w.seen.LoadOrStore(svc, true); done {
		return
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return
	}
	var streams []string
	for i := range sd.Methods().Len() {
		md := sd.Methods().Get(i)
		full := "/" + svc + "/" + string(md.Name())
		if (md.IsStreamingClient() || md.IsStreamingServer()) && s.selected(full) {
			streams = append(streams, full)
		}
	}
	if len(streams) > 0 {
		c.logger.ErrorContext(ctx, "idemreg: the service has streaming methods that are not de-duplicated and no stream interceptor refuses keyed calls to them; install client.Stream"+strings.Replace(entry, "Unary", "", 1),
			"interceptor", entry, "methods", streams)
	}
}

// StreamServerInterceptor refuses every streaming call to a selected method
// (WithMethods, WithMethodFilter; by default all) that carries an
// idempotency key: INVALID_ARGUMENT with reason IDEMPOTENCY_KEY_UNSUPPORTED
// and a BadRequest on idempotency-key (ErrKeyUnsupported), without running
// the handler. Streams are not de-duplicated, so a caller who sends a key
// learns it at once rather than after its retry ran a second time. Calls
// without a key pass through. Install it beside UnaryServerInterceptor,
// with the same options:
//
//	grpc.NewServer(
//		grpc.ChainUnaryInterceptor(client.UnaryServerInterceptor(reg, opts...)),
//		grpc.ChainStreamInterceptor(client.StreamServerInterceptor(reg, opts...)),
//	)
func StreamServerInterceptor(c *Client, opts ...InterceptorOption) grpc.StreamServerInterceptor {
	s := interceptorSettings(DefaultServerMissingKey, opts)
	c.streamGuard.Store(true)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if !s.selected(info.FullMethod) {
			return handler(srv, ss)
		}
		key, err := incomingKey(ss.Context())
		if err != nil {
			return err
		}
		if key != "" {
			return keyUnsupported(info.FullMethod, streamKind(info.IsClientStream, info.IsServerStream))
		}
		return handler(srv, ss)
	}
}

// StreamClientInterceptor refuses every outgoing streaming call to a
// selected method that carries an idempotency key (WithIdempotencyKey, or
// the idempotency-key metadata) with ErrKeyUnsupported, without opening
// the stream: streams are not de-duplicated. Calls without a key pass
// through. Install it beside UnaryClientInterceptor, with the same options.
func StreamClientInterceptor(c *Client, opts ...InterceptorOption) grpc.StreamClientInterceptor {
	s := interceptorSettings(DefaultClientMissingKey, opts)
	c.streamGuard.Store(true)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, callOpts ...grpc.CallOption) (grpc.ClientStream, error) {
		if !s.selected(method) {
			return streamer(ctx, desc, cc, method, callOpts...)
		}
		if _, ok := IdempotencyKey(ctx); ok {
			return nil, keyUnsupported(method, streamKind(desc.ClientStreams, desc.ServerStreams))
		}
		return streamer(ctx, desc, cc, method, callOpts...)
	}
}
