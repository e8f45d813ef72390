package adversarial

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
)

// rawPeer is an HTTP/2 client that sends what a gRPC client would refuse
// to (headers over the server's limit, more streams than it allows, frames
// out of order, garbage), as an abusive peer would.
type rawPeer struct {
	conn net.Conn
	fr   *http2.Framer
	next uint32
}

// dialRaw connects to addr; with handshake, it sends the client preface
// and its SETTINGS.
func dialRaw(t *testing.T, addr string, handshake bool) *rawPeer {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := &rawPeer{conn: c, fr: http2.NewFramer(c, c), next: 1}
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if handshake {
		_, err = c.Write([]byte(http2.ClientPreface))
		require.NoError(t, err)
		require.NoError(t, p.fr.WriteSettings())
	}
	return p
}

// headerBlock is the HPACK block of a gRPC call of method with pad bytes of
// extra headers, in fields of 4 KiB never indexed, so they arrive whole.
func headerBlock(method, token string, pad int) []byte {
	var block []byte
	enc := hpack.NewEncoder(appendWriter{&block})
	fields := [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "idemreg"},
		{"content-type", "application/grpc"}, {"te", "trailers"},
	}
	if token != "" {
		fields = append(fields, [2]string{"authorization", "Bearer " + token})
	}
	for _, f := range fields {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	for i := 0; pad > 0; i++ {
		n := min(pad, 4<<10)
		pad -= n
		_ = enc.WriteField(hpack.HeaderField{Name: "x-pad-" + strconv.Itoa(i), Value: randomText(n), Sensitive: true})
	}
	return block
}

// open starts a call with the header block, split in frames of 16 KiB;
// with body, it sends body as one gRPC message and ends the stream.
func (p *rawPeer) open(block []byte, body []byte) (uint32, error) {
	id := p.next
	p.next += 2
	const frame = 16 << 10
	first := block[:min(len(block), frame)]
	rest := block[len(first):]
	if err := p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndHeaders: len(rest) == 0}); err != nil {
		return 0, err
	}
	for len(rest) > 0 {
		chunk := rest[:min(len(rest), frame)]
		rest = rest[len(chunk):]
		if err := p.fr.WriteContinuation(id, len(rest) == 0, chunk); err != nil {
			return 0, err
		}
	}
	if body != nil {
		if err := p.fr.WriteData(id, true, body); err != nil {
			return 0, err
		}
	}
	return id, nil
}

// grpcMessage frames msg as one uncompressed gRPC message.
func grpcMessage(msg []byte) []byte {
	n := len(msg)
	return append([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, msg...)
}

// answer is what became of one stream.
type answer string

const (
	answerServed   answer = "served"   // grpc-status 0
	answerStatus   answer = "status"   // a gRPC error status
	answerReset    answer = "reset"    // RST_STREAM: refused by the transport
	answerConnGone answer = "closed"   // the connection went away
	answerPending  answer = "pending"  // nothing before the read deadline
	answerRefused  answer = "refused"  // RST_STREAM REFUSED_STREAM
	answerUnsent   answer = "unsent"   // the write failed: the server had closed
	answerGoAway   answer = "go-away"  // beyond a GOAWAY's last stream
	answerHTTPCode answer = "http-err" // an HTTP status other than 200
)

// await reads until every stream of ids has an answer or within, and
// returns the answers and the gRPC codes of the statuses.
func (p *rawPeer) await(ids []uint32, within time.Duration) (map[uint32]answer, map[uint32]codes.Code) {
	answers := map[uint32]answer{}
	codesOf := map[uint32]codes.Code{}
	for _, id := range ids {
		answers[id] = answerPending
	}
	pending := len(ids)
	settle := func(id uint32, a answer) {
		if answers[id] == answerPending {
			answers[id] = a
			pending--
		}
	}
	_ = p.conn.SetReadDeadline(time.Now().Add(within))
	for pending > 0 {
		f, err := p.fr.ReadFrame()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				break
			}
			for _, id := range ids {
				settle(id, answerConnGone)
			}
			break
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = p.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = p.fr.WritePing(true, f.Data)
			}
		case *http2.RSTStreamFrame:
			if f.ErrCode == http2.ErrCodeRefusedStream {
				settle(f.StreamID, answerRefused)
			} else {
				settle(f.StreamID, answerReset)
			}
		case *http2.MetaHeadersFrame:
			if v := f.PseudoValue("status"); v != "" && v != "200" {
				settle(f.StreamID, answerHTTPCode)
			}
			for _, hf := range f.RegularFields() {
				if hf.Name == "grpc-status" {
					n, _ := strconv.Atoi(hf.Value)
					codesOf[f.StreamID] = codes.Code(n)
					if n == 0 {
						settle(f.StreamID, answerServed)
					} else {
						settle(f.StreamID, answerStatus)
					}
				}
			}
		case *http2.GoAwayFrame:
			for _, id := range ids {
				if id > f.LastStreamID {
					settle(id, answerGoAway)
				}
			}
		}
	}
	_ = p.conn.SetReadDeadline(time.Time{})
	return answers, codesOf
}

// closedWithin reads (and drops) whatever the server sends until it
// closes the connection, and reports whether it did within d.
func (p *rawPeer) closedWithin(d time.Duration) bool {
	_ = p.conn.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	for {
		if _, err := p.conn.Read(buf); err != nil {
			var ne net.Error
			return !(errors.As(err, &ne) && ne.Timeout())
		}
	}
}

type appendWriter struct{ b *[]byte }

func (w appendWriter) Write(p []byte) (int, error) { *w.b = append(*w.b, p...); return len(p), nil }

func randomText(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

func count(answers map[uint32]answer, want ...answer) int {
	n := 0
	for _, a := range answers {
		for _, w := range want {
			if a == w {
				n++
			}
		}
	}
	return n
}
