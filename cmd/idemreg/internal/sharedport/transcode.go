package sharedport

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"connectrpc.com/vanguard"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/emptypb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
)

// What the HTTP API reads of a request, before anyone is authenticated.
// vanguard buffers each message whole, up to 4 GiB by default, and inflates
// gzip without a bound: a 256 KiB upload inflating to 256 MiB took the
// server past 1 GiB, and was answered INTERNAL. So a request is held to the
// gRPC side's receive limit (maxRequest, server.MaxRequestBytes) three
// times over, each where it is read:
//
//   - on the wire, the body: maxRequest plus wireSlack (envelopes and a
//     compression's overhead on incompressible data);
//   - inflated: the gzip reader stops one byte past maxRequest;
//   - buffered: vanguard's own limit, maxRequest plus twice wireSlack, so
//     that the two above come first. vanguard's own answers only a length
//     declared beyond it (a gRPC-Web envelope's), RESOURCE_EXHAUSTED, before
//     it reads the message.
//
// A request over the first two is handed on to the server marked
// (server.MarkMalformed), as JSON that does not decode is, and refused
// there: INVALID_ARGUMENT, reason MALFORMED_REQUEST, a 400, after
// authentication and under the caller's refusal budget (server/refusals.go),
// so that a tenant sending bombs is held like any caller refused too often.
// And none of it is read before the caller is known (messageRequired).
//
// A request between maxRequest and the wire's bound reaches grpc-go, which
// refuses it as it refuses it on the gRPC side (RESOURCE_EXHAUSTED). The
// server then receives requests uncompressed, so that grpc-go never
// inflates what vanguard did not.
const wireSlack = 64 << 10

// Callers tells from a request's connection and headers alone whether the
// server will know its caller: server.(*Server).Authenticates.
type Callers interface {
	Authenticates(fullMethod string, state *tls.ConnectionState, authorization []string) bool
}

// transcoder is vanguardgrpc.NewTranscoder without the internal services
// (idemreg.internal.*: the replicas' own RPC, which has no descriptor to
// transcode and is no API), with the bounds above, and with requests it
// cannot decode handed on to the server, marked (server.MarkMalformed), so
// that the server refuses them after authentication, logged and counted,
// as it refuses a malformed gRPC request. The body of a call whose caller
// callers does not know is not read at all (nil callers: every body is).
func transcoder(g *grpc.Server, callers Callers, maxRequest int) (*vanguard.Transcoder, error) {
	codecs := []string{vanguard.CodecProto}
	if encoding.GetCodec(vanguard.CodecJSON) != nil {
		codecs = append(codecs, vanguard.CodecJSON)
	}
	target := messageRequired(g, callers, maxRequest)
	var services []*vanguard.Service
	for name := range g.GetServiceInfo() {
		if !strings.HasPrefix(name, "idemreg.internal.") {
			services = append(services, vanguard.NewService(name, target))
		}
	}
	return vanguard.NewTranscoder(services,
		vanguard.WithCodec(func(r vanguard.TypeResolver) vanguard.Codec { return markingJSON{vanguard.NewJSONCodec(r)} }),
		vanguard.WithCompression(vanguard.CompressionGzip,
			func() connect.Compressor { return gzip.NewWriter(io.Discard) },
			func() connect.Decompressor { return &boundedGzip{limit: int64(maxRequest)} }),
		vanguard.WithDefaultServiceOptions(
			vanguard.WithTargetCodecs(codecs...), vanguard.WithTargetProtocols(vanguard.ProtocolGRPC),
			vanguard.WithNoTargetCompression(),
			vanguard.WithMaxMessageBufferBytes(uint32(maxRequest+2*wireSlack))))
}

// tooLargeDetail is what the server's refusal of a request over limit
// bytes, wire or inflated, says of it.
func tooLargeDetail(limit int64) string {
	return fmt.Sprintf("the request is larger than the %d bytes the server accepts", limit)
}

// tooLarge is the error of a body read past limit bytes: vanguard hands it
// to messageRequired, which hands the server a message marked with its
// text; were vanguard to answer it itself, it would answer this.
func tooLarge(limit int64) error {
	r := idemregv1.ErrorReason_ERROR_REASON_MALFORMED_REQUEST
	err := connect.NewError(connect.CodeInvalidArgument, errors.New(tooLargeDetail(limit)))
	if d, derr := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: r.Reason(), Domain: idemregv1.ErrorDomain,
		Metadata: map[string]string{"limit_bytes": strconv.FormatInt(limit, 10)}}); derr == nil {
		err.AddDetail(d)
	}
	return err
}

// boundBody holds a request's body on the wire to maxRequest plus
// wireSlack. http.MaxBytesReader also has the connection closed after the
// answer, rather than the rest of the body read.
func boundBody(maxRequest int, next http.Handler) http.Handler {
	limit := int64(maxRequest + wireSlack)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r = r.WithContext(context.WithValue(r.Context(), sentKey{}, r.ContentLength))
		if r.ContentLength > limit {
			// vanguard would refuse it unread, RESOURCE_EXHAUSTED and a
			// 429 (retry later); it is read to the bound instead, so that
			// every request too large is answered alike.
			r.ContentLength = -1
		}
		r.Body = &wireBody{r: http.MaxBytesReader(w, r.Body, limit), limit: limit}
		next.ServeHTTP(w, r)
	})
}

// sentKey carries the length a request declared (-1: none) past the
// transcoder, whose own request to the server declares none.
type sentKey struct{}

// wireBody answers a body over its bound with tooLarge, which vanguard
// sends as it is (any other error it answers 500).
type wireBody struct {
	r     io.ReadCloser
	limit int64
}

func (b *wireBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		err = tooLarge(b.limit)
	}
	return n, err
}

func (b *wireBody) Close() error { return b.r.Close() }

// boundedGzip is vanguard's gzip decompressor, stopped once it has
// inflated one byte past limit.
type boundedGzip struct {
	gz    gzip.Reader
	limit int64
	n     int64
	// over is what is read in place of a message over limit: a message
	// marked too large, which the server refuses (vanguard would answer
	// an error itself, before authentication and outside any budget).
	over *bytes.Reader
}

// Reset first inflates the message into nothing, to count it, when it is
// buffered whole (vanguard hands it so): a bomb is then refused before a
// byte of it is kept, where vanguard's buffer, growing by doubling, would
// have taken three times the limit (measured: 17 MiB above the idle
// server for one bomb, 64 MiB for four). A message under the limit is
// inflated twice, which only a compressed request costs.
func (d *boundedGzip) Reset(r io.Reader) error {
	d.n, d.over = 0, nil
	if b, ok := r.(*bytes.Buffer); ok {
		if err := d.gz.Reset(bytes.NewReader(b.Bytes())); err != nil {
			return err
		}
		n, err := io.Copy(io.Discard, io.LimitReader(&d.gz, d.limit+1))
		if err != nil {
			return err
		}
		if n > d.limit {
			d.over = bytes.NewReader(tooLargeMessage(d.limit))
			return nil
		}
	}
	return d.gz.Reset(r)
}

func (d *boundedGzip) Read(p []byte) (int, error) {
	if d.over != nil {
		return d.over.Read(p)
	}
	if d.n > d.limit {
		return 0, tooLarge(d.limit)
	}
	if rest := d.limit + 1 - d.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := d.gz.Read(p)
	d.n += int64(n)
	if d.n > d.limit {
		return n, tooLarge(d.limit)
	}
	return n, err
}

func (d *boundedGzip) Close() error { return d.gz.Close() }

// markingJSON is vanguard's JSON codec, except that a request that does not
// decode is handed on marked rather than answered by vanguard (a 500
// "unknown" echoing the whole value, before any interceptor).
type markingJSON struct{ *vanguard.JSONCodec }

func (c markingJSON) Unmarshal(data []byte, msg proto.Message) error {
	if bytes.HasPrefix(data, markTag) {
		// A message boundedGzip marked too large: no JSON begins with
		// the tag's first byte (0xFA), and its detail is kept.
		if err := proto.Unmarshal(data, msg); err == nil {
			return nil
		}
	}
	if err := c.JSONCodec.Unmarshal(data, msg); err != nil {
		server.MarkMalformed(msg, "JSON: "+err.Error())
	}
	return nil
}

// messageRequired reads a unary or server-streaming call's request
// message, whose single message is required, before g runs, and hands g a
// marked message (server.MarkMalformed) in its place when there is none,
// which the server refuses MALFORMED_REQUEST after authentication, logged
// and counted: an empty body (a Connect call's or a gRPC-Web call's),
// which grpc-go would answer INTERNAL ("cardinality violation") before any
// interceptor, and a body vanguard stopped reading with an error (one
// over the wire's bound without a length, which vanguard hands on rather
// than answers, or one it refused and answered itself: the caller has that
// answer, and the server's is dropped). A client stream may be empty, and
// is handed on as it comes.
//
// It is read here, on the handler's goroutine, because vanguard answers a
// request it refuses while the request is read, and grpc-go reads on a
// goroutine of its own while its handler may answer too (a cancelled
// call): the race detector caught the two writing the response's headers
// at once.
func messageRequired(g *grpc.Server, callers Callers, maxRequest int) http.Handler {
	// From the API's descriptors, not g's service info: the server
	// registers its unary methods as client streams, to answer a call with
	// no message itself (server/codec.go, decodingRegistrar).
	single := map[string]bool{}
	for svc := range g.GetServiceInfo() {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
		sd, ok := d.(protoreflect.ServiceDescriptor)
		if err != nil || !ok {
			continue // no descriptor: not transcoded either
		}
		for i := range sd.Methods().Len() {
			m := sd.Methods().Get(i)
			single["/"+svc+"/"+string(m.Name())] = !m.IsStreamingClient()
		}
	}
	// vanguard's buffer bound, and a message's envelope.
	limit := int64(maxRequest + 2*wireSlack + 5)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case callers != nil && !callers.Authenticates(r.URL.Path, r.TLS, r.Header.Values("Authorization")):
			// Nothing of an unknown caller's body is read, let alone
			// inflated: g's chain answers UNAUTHENTICATED, logs it
			// sampled, counts it and holds it under the source's refusal
			// budget, as for a gRPC caller without credentials. Should
			// g know the caller after all (a config reload in between),
			// the message it gets is refused, never served. Its
			// connection is closed after the answer, rather than the
			// rest of the body read to keep it (net/http reads up to
			// 256 KiB of it).
			// What it sent costs its source's refusal budget (a 256 KiB
			// body 17 refusals), so that a loop of large bodies is held
			// sooner than one of small calls.
			w.Header().Set("Connection", "close")
			sent, _ := r.Context().Value(sentKey{}).(int64) // vanguard's request has no length
			if sent < 0 {
				sent = wireSlack // chunked: what the connection buffers, about
			}
			r = r.WithContext(server.WithRequestBytes(r.Context(), sent))
			r.Body = unread(r.Body, single[r.URL.Path])
		case single[r.URL.Path]:
			r.Body = readMessage(r.Body, limit)
		}
		g.ServeHTTP(w, r)
	})
}

// unread stands for body, none of which is read: a message marked unread
// when the call has one, nothing otherwise.
func unread(body io.ReadCloser, single bool) io.ReadCloser {
	var frame []byte
	if single {
		frame = markedFrame("the request was not read: its caller was not authenticated")
	}
	return struct {
		io.Reader
		io.Closer
	}{bytes.NewReader(frame), body}
}

// readMessage reads body, a transcoded gRPC request of one message, and
// returns it to be read again, or a marked message when it had none or was
// not one message.
func readMessage(body io.ReadCloser, limit int64) io.ReadCloser {
	frame := readFrame(body, limit)
	return struct {
		io.Reader
		io.Closer
	}{bytes.NewReader(frame), body}
}

// readFrame reads the one gRPC message frame of body into a buffer of its
// size (read whole, a buffer growing by doubling took twice the message),
// then the body's end; or returns a marked frame that says why it could
// not.
func readFrame(body io.Reader, limit int64) []byte {
	var head [5]byte
	if n, err := io.ReadFull(body, head[:]); err != nil {
		if n == 0 && errors.Is(err, io.EOF) {
			return markedFrame("no request message arrived")
		}
		return failedFrame(err)
	}
	n := int64(binary.BigEndian.Uint32(head[1:]))
	if n > limit {
		return frameOf(tooLargeMessage(limit))
	}
	frame := make([]byte, 5+n)
	copy(frame, head[:])
	if _, err := io.ReadFull(body, frame[5:]); err != nil {
		return failedFrame(err)
	}
	// The body's end is read here too: asked for more, vanguard reads the
	// next message, and answers one that is broken.
	var more [1]byte
	switch _, err := io.ReadFull(body, more[:]); {
	case err == nil:
		return markedFrame("more than one request message arrived")
	case !errors.Is(err, io.EOF):
		return failedFrame(err)
	}
	return frame
}

// failedFrame is the marked frame of a body that failed: too large (the
// wire's bound, tooLarge), or vanguard's error, by its message.
func failedFrame(err error) []byte {
	ce := (*connect.Error)(nil)
	if !errors.As(err, &ce) {
		return markedFrame(err.Error())
	}
	for _, d := range ce.Details() {
		if v, derr := d.Value(); derr == nil {
			if info, ok := v.(*errdetails.ErrorInfo); ok {
				if limit, perr := strconv.ParseInt(info.GetMetadata()["limit_bytes"], 10, 64); perr == nil {
					return frameOf(tooLargeMessage(limit))
				}
			}
		}
	}
	return markedFrame(ce.Message())
}

// markedFrame is a gRPC message frame of a request marked malformed with
// detail.
func markedFrame(detail string) []byte {
	return frameOf(markedMessage(detail))
}

// frameOf is the gRPC message frame of the encoded message b.
func frameOf(b []byte) []byte {
	return append(binary.BigEndian.AppendUint32([]byte{0}, uint32(len(b))), b...)
}

// markedMessage is the protobuf encoding of a request marked malformed
// with detail.
func markedMessage(detail string) []byte {
	m := &emptypb.Empty{}
	server.MarkMalformed(m, detail)
	return encodeMarked(m)
}

// tooLargeMessage is the protobuf encoding of a request marked too large
// for limit bytes (server.MarkTooLarge), whose refusal the server holds.
func tooLargeMessage(limit int64) []byte {
	m := &emptypb.Empty{}
	server.MarkTooLarge(m, limit)
	return encodeMarked(m)
}

func encodeMarked(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		// An empty message with bounded unknown fields always encodes; an
		// empty one still makes the call refused.
		return nil
	}
	return b
}

// markTag is how a marked message begins: the mark's field tag, without
// its length.
var markTag = func() []byte {
	b := markedMessage("")
	return b[:len(b)-1]
}()
