package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
)

// Malformed requests. gRPC decodes a request before any interceptor runs,
// and answers a codec's failure itself, with INTERNAL (a status the docs
// call a bug signal), before the access log or the metrics of our
// interceptors have seen the call. So the server's codec does not decode a
// request: it hands its bytes over as a rawRequest, and the handlers the
// server registers (decodingRegistrar) decode them inside the interceptor
// chain. A request that does not decode is then the caller's mistake like
// any invalid field: INVALID_ARGUMENT, reason MALFORMED_REQUEST, refused
// after authentication (an unknown caller learns nothing more than
// UNAUTHENTICATED), logged by the access log and counted by otelgrpc under
// its code like every refused call.
//
// requestCodec is the server's codec: the proto codec, except that a
// rawRequest receives the bytes of a message undecoded.
type requestCodec struct{ proto encoding.CodecV2 }

func newRequestCodec() requestCodec {
	return requestCodec{proto: encoding.GetCodecV2(protocodec.Name)}
}

func (c requestCodec) Name() string { return protocodec.Name }

func (c requestCodec) Marshal(v any) (mem.BufferSlice, error) { return c.proto.Marshal(v) }

func (c requestCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*rawRequest); ok {
		// gRPC frees data when Unmarshal returns; the reference keeps it
		// until decode. A second message (a cardinality violation gRPC
		// answers itself) replaces the first.
		r.free()
		data.Ref()
		r.data = data
		return nil
	}
	return c.proto.Unmarshal(data, v)
}

// rawRequest is a request's bytes as they arrived, or, for a call that did
// not send exactly one message, why not (missing).
type rawRequest struct {
	data    mem.BufferSlice
	missing string
}

func (r *rawRequest) free() {
	r.data.Free()
	r.data = nil
}

// decode unmarshals the bytes into m and releases them. A failure leaves m
// empty, so that nothing reads a half-decoded request, and is the
// MALFORMED_REQUEST status.
func (r *rawRequest) decode(m any) error {
	defer r.free()
	var msg proto.Message
	switch m := m.(type) {
	case protoadapt.MessageV2:
		msg = m
	case protoadapt.MessageV1:
		msg = protoadapt.MessageV2Of(m)
	default:
		return reason.Status(idemregv1.ErrorReason_ERROR_REASON_INTERNAL, "internal error", nil)
	}
	var err error
	var tooLarge int64
	if r.missing != "" {
		err = errors.New(r.missing)
	} else {
		buf := r.data.MaterializeToBuffer(mem.DefaultBufferPool())
		defer buf.Free()
		if err = proto.Unmarshal(buf.ReadOnlyData(), msg); err == nil {
			m, marked := markOf(msg.ProtoReflect().GetUnknown())
			if !marked {
				return nil
			}
			err, tooLarge = errors.New(m.detail), m.limit
		}
	}
	proto.Reset(msg)
	name := string(msg.ProtoReflect().Descriptor().FullName())
	meta := map[string]string{"message": name}
	if tooLarge > 0 {
		meta[limitBytesKey] = strconv.FormatInt(tooLarge, 10)
	}
	return reason.Status(idemregv1.ErrorReason_ERROR_REASON_MALFORMED_REQUEST,
		"the request is not a valid encoding of "+name+": "+reason.Echo(err.Error()), meta)
}

// Requests a transcoder in front of the server could not decode. The HTTP
// API's transcoder decodes a JSON request, or inflates a compressed one,
// before the server sees it, and answered what it could not decode itself,
// before any interceptor: no authentication first, no access log line, no
// metric, a 500. So it hands such a request on instead, as a message that
// carries only this mark: an unknown field, of the largest number protobuf
// allows (no message of the API comes near it), whose value says what was
// wrong. The server refuses a marked request as it refuses bytes that do not
// decode, inside the interceptor chain. A gRPC caller that sends the mark
// itself only gets its own request refused.
const malformedMark = protowire.MaxValidNumber

// MarkMalformed makes msg a request that the server refuses with
// INVALID_ARGUMENT, reason MALFORMED_REQUEST, quoting detail (cut to
// MaxEchoedFieldBytes): what a transcoder in front of the server sends for
// a request it could not decode, so that the refusal is the server's.
func MarkMalformed(msg proto.Message, detail string) {
	proto.Reset(msg)
	b := protowire.AppendTag(nil, malformedMark, protowire.BytesType)
	msg.ProtoReflect().SetUnknown(protowire.AppendString(b, reason.Echo(detail)))
}

// MarkTooLarge makes msg a request refused as MarkMalformed's, for a
// request larger than limit bytes (on the wire, or inflated), whose
// ErrorInfo says the limit (limit_bytes). Reading or inflating such a
// request up to the limit cost the server what hundreds of refused calls
// cost, and its refusal costs its caller's refusal budget as many
// (refusalCost: more than the default budget's burst, so it is held).
func MarkTooLarge(msg proto.Message, limit int64) {
	MarkMalformed(msg, fmt.Sprintf("the request is larger than the %d bytes the server accepts", limit))
	b := msg.ProtoReflect().GetUnknown()
	b = protowire.AppendTag(b, tooLargeMark, protowire.VarintType)
	msg.ProtoReflect().SetUnknown(protowire.AppendVarint(b, uint64(limit)))
}

// tooLargeMark is the field beside malformedMark that MarkTooLarge adds.
const tooLargeMark = malformedMark - 1

// limitBytesKey is the ErrorInfo metadata of a refusal of a request too
// large: the limit, in bytes.
const limitBytesKey = "limit_bytes"

// mark is what a transcoder's mark says.
type mark struct {
	detail string
	limit  int64 // MarkTooLarge's, or 0
}

// markOf returns the mark among a request's unknown fields, if it has one.
func markOf(unknown []byte) (m mark, marked bool) {
	for len(unknown) > 0 {
		num, typ, n := protowire.ConsumeTag(unknown)
		if n < 0 {
			return m, marked
		}
		unknown = unknown[n:]
		switch {
		case num == malformedMark && typ == protowire.BytesType:
			v, k := protowire.ConsumeBytes(unknown)
			if k < 0 {
				return m, marked
			}
			m.detail, marked = string(v), true
		case num == tooLargeMark && typ == protowire.VarintType:
			v, k := protowire.ConsumeVarint(unknown)
			if k < 0 {
				return m, marked
			}
			m.limit = int64(min(v, math.MaxInt64))
		}
		k := protowire.ConsumeFieldValue(num, typ, unknown)
		if k < 0 {
			return m, marked
		}
		unknown = unknown[k:]
	}
	return m, marked
}

// refusedTooLarge returns the limit of a refusal err of a request marked
// too large.
func refusedTooLarge(err error) (limit int64, ok bool) {
	st, isStatus := status.FromError(err)
	if !isStatus || st.Code() != codes.InvalidArgument {
		return 0, false
	}
	for _, d := range st.Details() {
		if info, isInfo := d.(*errdetails.ErrorInfo); isInfo {
			if limit, perr := strconv.ParseInt(info.GetMetadata()[limitBytesKey], 10, 64); perr == nil {
				return limit, true
			}
		}
	}
	return 0, false
}

// maxRequestBytes is the largest request message the server receives:
// room for the largest allowed result plus the rest of a request, and for
// a batch a little over its bound, to be told INVALID_ARGUMENT.
func maxRequestBytes(l Limits) int { return max(l.MaxResultBytes+64<<10, MaxBatchBytes+1<<20) }

// MaxRequestBytes is the largest request message the server receives,
// decoded and inflated: the bound a transcoder in front of it must hold
// too, before it buffers a request for it.
func (s *Server) MaxRequestBytes() int { return maxRequestBytes(s.cfg.Limits) }

// malformedKey carries a unary request's decoding failure from its
// handler's decoding to refuseMalformed.
type malformedKey struct{}

// refuseMalformed answers a request that did not decode with its
// MALFORMED_REQUEST status.
func refuseMalformed(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	if err, ok := ctx.Value(malformedKey{}).(error); ok {
		return nil, err
	}
	return next(ctx, req)
}

// decodingRegistrar registers services on a gRPC server with handlers that
// decode their requests themselves, from the rawRequest of requestCodec:
// a unary request inside the interceptor chain, a stream's messages as the
// handler receives them. It is also what reflection.Register needs.
//
// A unary method is registered as a client stream (carriedUnary), and a
// server stream as a bidirectional one (singleStream), so that a call that
// sends no message, or more than one, is the server's to answer:
// registered as they are, grpc-go refuses it itself, INTERNAL
// ("cardinality violation"), written in serverStream.RecvMsg before any
// handler or interceptor runs. Anyone could send one (an HTTP/2 stream
// whose HEADERS end it), and get the status the docs keep for the
// server's own faults.
type decodingRegistrar struct {
	*grpc.Server
	carried *carriedUnary
}

func (r decodingRegistrar) RegisterService(sd *grpc.ServiceDesc, impl any) {
	d := *sd
	d.Methods = nil
	d.Streams = make([]grpc.StreamDesc, 0, len(sd.Streams)+len(sd.Methods))
	for _, s := range sd.Streams {
		h := s.Handler
		if s.ClientStreams {
			s.Handler = func(srv any, ss grpc.ServerStream) error { return h(srv, decodingStream{ss}) }
		} else {
			// A server stream's one request, received as a unary call's.
			s.ClientStreams = true
			s.Handler = func(srv any, ss grpc.ServerStream) error { return h(srv, singleStream{ss}) }
		}
		d.Streams = append(d.Streams, s)
	}
	for _, m := range sd.Methods {
		d.Streams = append(d.Streams, grpc.StreamDesc{StreamName: m.MethodName, ClientStreams: true,
			Handler: r.carried.handler(decodingUnary(m.Handler))})
		r.carried.methods["/"+sd.ServiceName+"/"+m.MethodName] = true
	}
	r.Server.RegisterService(&d, impl)
}

// carriedUnary runs the unary methods a decodingRegistrar registered as
// client streams: each under the unary interceptor chain it was given (the
// one the server would have run), and past the server's stream
// interceptors (streams), which are for its real streams. Its methods are
// filled at registration, before the server serves, and only read after.
type carriedUnary struct {
	unary   grpc.UnaryServerInterceptor
	methods map[string]bool
}

func newCarriedUnary(unary grpc.UnaryServerInterceptor) *carriedUnary {
	return &carriedUnary{unary: unary, methods: map[string]bool{}}
}

// handler runs h, a unary handler, on the stream's one message.
func (c *carriedUnary) handler(h grpc.MethodHandler) grpc.StreamHandler {
	return func(srv any, ss grpc.ServerStream) error {
		reply, err := h(srv, ss.Context(), oneMessage(ss), c.unary)
		if err != nil {
			return err
		}
		return ss.SendMsg(reply)
	}
}

// streams is the server's stream interceptor: chain for its streams, none
// for the unary methods it carries.
func (c *carriedUnary) streams(chain grpc.StreamServerInterceptor) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if c.methods[info.FullMethod] {
			return handler(srv, ss)
		}
		return chain(srv, ss, info, handler)
	}
}

// oneMessage receives a unary call's request into a rawRequest, as
// grpc-go's unary path would, except that no message, or a second one,
// makes it a request that does not decode (missing), refused
// MALFORMED_REQUEST inside the interceptor chain, after authentication.
func oneMessage(ss grpc.ServerStream) func(any) error {
	return func(m any) error {
		raw := m.(*rawRequest)
		if err := ss.RecvMsg(raw); err != nil {
			if !errors.Is(err, io.EOF) {
				return err // gRPC's own: too large, bad compression
			}
			raw.missing = "no request message arrived"
			return nil
		}
		var extra rawRequest
		err := ss.RecvMsg(&extra)
		extra.free()
		switch {
		case err == nil:
			raw.free()
			raw.missing = "more than one request message arrived"
		case !errors.Is(err, io.EOF):
			return err
		}
		return nil
	}
}

// decodingUnary runs a generated unary handler on the request's bytes. The
// generated handler decodes before it calls the interceptors and returns
// at once if decoding fails, so the decoding it is given never fails: a
// failure goes to the interceptors in the context, and refuseMalformed
// answers it there.
func decodingUnary(h grpc.MethodHandler) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		var raw rawRequest
		defer raw.free()
		if err := dec(&raw); err != nil {
			return nil, err // gRPC's own: too large, bad compression
		}
		var malformed error
		decode := func(m any) error {
			malformed = raw.decode(m)
			return nil
		}
		return h(srv, ctx, decode, func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if malformed != nil {
				ctx = context.WithValue(ctx, malformedKey{}, malformed)
			}
			if interceptor == nil {
				return refuseMalformed(ctx, req, info, handler)
			}
			return interceptor(ctx, req, info, handler)
		})
	}
}

// decodingStream decodes a stream's messages from their bytes; one that
// does not decode ends the stream with its MALFORMED_REQUEST status.
type decodingStream struct{ grpc.ServerStream }

func (s decodingStream) RecvMsg(m any) error {
	var raw rawRequest
	if err := s.ServerStream.RecvMsg(&raw); err != nil {
		raw.free()
		return err
	}
	return raw.decode(m)
}

// singleStream receives a server stream's one request message as
// oneMessage receives a unary call's: no message, or a second one, is the
// stream's MALFORMED_REQUEST status.
type singleStream struct{ grpc.ServerStream }

func (s singleStream) RecvMsg(m any) error {
	var raw rawRequest
	if err := oneMessage(s.ServerStream)(&raw); err != nil {
		raw.free()
		return err
	}
	return raw.decode(m)
}
