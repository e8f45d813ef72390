package adversarial

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// The HTTP API on serve's gRPC port (issue 35): what an anonymous peer
// makes the transcoder do before anyone is authenticated.

// httpAnswer is the HTTP API's answer to one call: the HTTP status and the
// Connect error's code, or gRPC-Web's grpc-status, with the ErrorInfo's
// reason and the message.
type httpAnswer struct {
	status        int
	code, message string
	reason        string
}

// postHTTP POSTs body to a RegistryService method on serve's gRPC port with
// the headers given (name, value, ...) and reads the answer.
func postHTTP(ctx context.Context, s *suite, method string, body []byte, header ...string) (httpAnswer, error) {
	return postHTTPWith(ctx, http.DefaultClient, s, method, body, header...)
}

// postHTTPWith is postHTTP with the client c (another source address).
func postHTTPWith(ctx context.Context, c *http.Client, s *suite, method string, body []byte, header ...string) (httpAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.addr+"/idemreg.v1.RegistryService/"+method, bytes.NewReader(body))
	if err != nil {
		return httpAnswer{}, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := c.Do(req)
	if err != nil {
		return httpAnswer{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 4<<20))
	if err != nil {
		return httpAnswer{}, err
	}
	a := httpAnswer{status: res.StatusCode}
	if strings.HasPrefix(res.Header.Get("Content-Type"), "application/grpc-web") {
		a.code, a.message = res.Header.Get("Grpc-Status"), res.Header.Get("Grpc-Message")
		for len(b) >= 5 && b[0]&0x80 != 0 { // the trailers frame
			n := binary.BigEndian.Uint32(b[1:5])
			for l := range strings.SplitSeq(string(b[5:min(int(5+n), len(b))]), "\r\n") {
				k, v, _ := strings.Cut(l, ":")
				if strings.EqualFold(k, "grpc-status") {
					a.code = strings.TrimSpace(v)
				}
			}
			break
		}
		return a, nil
	}
	if res.StatusCode == http.StatusOK {
		return a, nil
	}
	var ce struct {
		Code, Message string
		Details       []struct{ Type, Value string }
	}
	if err := json.Unmarshal(b, &ce); err != nil {
		return a, fmt.Errorf("%d %.200q: %w", res.StatusCode, b, err)
	}
	a.code, a.message = ce.Code, ce.Message
	for _, d := range ce.Details {
		if d.Type == "google.rpc.ErrorInfo" {
			raw, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(d.Value, "="))
			if err != nil {
				return a, err
			}
			var info errdetails.ErrorInfo
			if err := proto.Unmarshal(raw, &info); err != nil {
				return a, err
			}
			a.reason = info.GetReason()
		}
	}
	return a, nil
}

func gzipBytes(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	require.NoError(t, err)
	_, err = w.Write(b)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	return buf.Bytes()
}

// httpCompressionBomb (issue 35, vulnerability 1): workers POST
// compression bombs, each about 256 KiB on the wire inflating to 256 MiB,
// in turn a Connect JSON call (Content-Encoding: gzip), a Connect proto
// call and a gRPC-Web call (a gzip message), as fast as they are answered.
//
// As alpha, 4 at once, 3 times, serve otherwise idle: each is answered
// INVALID_ARGUMENT with ErrorInfo MALFORMED_REQUEST (gRPC-Web: grpc-status
// 3), never a 5xx, and serve's peak resident memory grows by at most 5 MiB
// per upload in flight, twice that for the -race binary's shadow memory
// (measured 16–17 MiB for 4; the plain binary's under 1 MiB: a bomb is
// counted, never kept). Before: 1,026 MiB for one and 2,857 MiB for four
// (the plain binary), the answer RESOURCE_EXHAUSTED after inflating it
// whole. Then alpha's 4 workers send bombs beside the neighbour: each
// costs inflating 5 MiB to count it, so its refusal is held
// (--refusal-delay) whatever alpha's budget (server.MarkTooLarge). Bound:
// the neighbour keeps at least half its throughput. Before, alpha's
// budget, counted in calls (100 a second), was more than 4 workers send,
// nothing was held, and the neighbour kept 6–12%.
//
// Without credentials, from a source of their own (127.0.0.2), 4 workers
// beside the neighbour: each bomb is answered UNAUTHENTICATED (401;
// gRPC-Web grpc-status 16) with none of it read, and held under the
// source's refusal budget. Bound: the neighbour keeps at least half its
// throughput (neighbourShareUnderRefusals). Before, each anonymous bomb
// was inflated to 5 MiB to count it and answered at once: the neighbour
// kept 5–12%.
func httpCompressionBomb(t *testing.T, s *suite) {
	const inflated, workers = 256 << 20, 4
	key := bytes.Repeat([]byte("k"), inflated)
	jsonBomb := gzipBytes(t, append(append([]byte(`{"consumer":"alpha.bomb","kind":"KIND_MESSAGE","key":"`), key...), `"}`...))
	msg, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "alpha.bomb", Kind: op, Key: string(key)})
	require.NoError(t, err)
	key = nil
	protoBomb := gzipBytes(t, msg)
	msg = nil
	webBomb := append(binary.BigEndian.AppendUint32([]byte{1}, uint32(len(protoBomb))), protoBomb...)
	bombs := []struct {
		body   []byte
		header []string
		web    bool
	}{
		{jsonBomb, []string{"Content-Type", "application/json", "Content-Encoding", "gzip"}, false},
		{protoBomb, []string{"Content-Type", "application/proto", "Connect-Protocol-Version", "1", "Content-Encoding", "gzip"}, false},
		{webBomb, []string{"Content-Type", "application/grpc-web+proto", "Grpc-Encoding", "gzip"}, true},
	}
	t.Logf("bombs of %d KiB (JSON), %d KiB (proto), each inflating to %d MiB", len(jsonBomb)>>10, len(protoBomb)>>10, inflated>>20)

	// send sends the i-th bomb with c, as the identity of token ("": none).
	send := func(ctx context.Context, c *http.Client, token string, i int) error {
		b := bombs[i%len(bombs)]
		header := b.header
		if token != "" {
			header = append(header[:len(header):len(header)], "Authorization", "Bearer "+token)
		}
		a, err := postHTTPWith(ctx, c, s, "Claim", b.body, header...)
		if err != nil {
			return err
		}
		switch {
		case token == "" && b.web:
			if a.status != http.StatusOK || a.code != "16" {
				return fmt.Errorf("an anonymous bomb answered %+v", a)
			}
		case token == "":
			if a.status != http.StatusUnauthorized || a.code != "unauthenticated" || a.reason != idemregv1.ReasonUnauthenticated {
				return fmt.Errorf("an anonymous bomb answered %+v", a)
			}
		case b.web:
			if a.status != http.StatusOK || a.code != "3" {
				return fmt.Errorf("a bomb answered %+v", a)
			}
		default:
			if a.status != http.StatusBadRequest || a.code != "invalid_argument" || a.reason != idemregv1.ReasonMalformedRequest {
				return fmt.Errorf("a bomb answered %+v", a)
			}
		}
		return nil
	}

	// Memory: 3 waves of 4 at once as alpha (an anonymous bomb is not
	// read), serve otherwise idle; the peak resident memory from here on
	// (VmHWM, reset).
	require.NoError(t, os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", s.cmd.Process.Pid), []byte("5"), 0))
	before := residentBytes(t, s)
	for wave := range 3 {
		var wg sync.WaitGroup
		errs := make([]error, workers)
		for w := range workers {
			wg.Go(func() { errs[w] = send(t.Context(), http.DefaultClient, alphaToken, wave*workers+w) })
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
	}
	grown := int64(peakResidentBytes(t, s)) - int64(before)
	const bound = 2 * workers * 5 << 20
	t.Logf("%d bombs, %d at once: serve's peak resident memory %d KiB above before (bound %d MiB)", 3*workers, workers, grown>>10, bound>>20)
	require.LessOrEqual(t, grown, int64(bound))

	// flood has the workers send bombs with c as token's identity, as fast
	// as they are answered, beside the neighbour.
	flood := func(t *testing.T, c *http.Client, token string, minShare float64) {
		var sent atomic.Int64
		s.underAttack(t, minShare, func(ctx context.Context, ready func()) {
			var wg sync.WaitGroup
			for w := range workers {
				wg.Go(func() {
					for i := w; i < 10_000 && ctx.Err() == nil; i++ {
						err := send(ctx, c, token, i)
						if ctx.Err() != nil {
							return
						}
						if err != nil {
							t.Error(err)
							return
						}
						if sent.Add(1) == workers {
							ready()
						}
					}
				})
			}
			wg.Wait()
		})
		t.Logf("%d bombs answered under the neighbour", sent.Load())
	}
	// alpha's first: its refusal budget refills while the anonymous flood
	// runs, for the cases after this one.
	t.Run("as alpha", func(t *testing.T) {
		before := s.metric(t, "idemreg_refusals_slowed_total", `by="identity"`, `result="held"`)
		flood(t, http.DefaultClient, alphaToken, neighbourShareUnderRefusals)
		held := s.metric(t, "idemreg_refusals_slowed_total", `by="identity"`, `result="held"`) - before
		t.Logf("%.0f of alpha's bombs' refusals held", held)
	})
	t.Run("without credentials", func(t *testing.T) {
		before := s.metric(t, "idemreg_refusals_slowed_total", `by="source"`, `result="held"`)
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
		tr := &http.Transport{DialContext: d.DialContext}
		defer tr.CloseIdleConnections()
		flood(t, &http.Client{Transport: tr}, "", neighbourShareUnderRefusals)
		held := s.metric(t, "idemreg_refusals_slowed_total", `by="source"`, `result="held"`) - before
		t.Logf("%.0f of the anonymous bombs' refusals held", held)
	})
}

// peakResidentBytes is serve's peak resident set size (VmHWM).
func peakResidentBytes(t *testing.T, s *suite) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

// httpBadJSON (issue 35, weakness 1): alpha POSTs JSON that does not decode
// into the request: broken, a duration in hours ("1h", protojson wants
// "3600s"), an int64 overflow, an unknown enum number, a 1 MB value.
// Bound: each 400, invalid_argument, ErrorInfo MALFORMED_REQUEST, its
// message under 1 KiB (the 1 MB value quoted to 256 bytes); each logged as
// alpha's INVALID_ARGUMENT (or counted as left out by sampling), none
// INTERNAL; without credentials the same body is 401 (authentication
// first). Before: 500, "unknown", the value echoed whole, no ErrorInfo,
// and an unsampled ERROR line ("cardinality violation") per call.
func httpBadJSON(t *testing.T, s *suite) {
	ctx := t.Context()
	bodies := []struct{ name, method, body string }{
		{"broken", "Claim", `{"consumer":`},
		{"hours", "Claim", `{"consumer":"alpha.json","kind":"KIND_MESSAGE","key":"k","lease":"1h"}`},
		{"int64 overflow", "Complete", `{"consumer":"alpha.json","kind":"KIND_MESSAGE","key":"k","token":"99999999999999999999999"}`},
		{"unknown enum", "Claim", `{"consumer":"alpha.json","kind":99999999999,"key":"k"}`},
		{"1 MB value", "Claim", `{"consumer":"alpha.json","kind":"KIND_MESSAGE","key":"k","lease":"` + strings.Repeat("9", 1<<20) + `"}`},
	}
	linesBefore := s.logs.finished("alpha", "INVALID_ARGUMENT")
	sampledBefore := s.metric(t, "idemreg_access_log_sampled_out_total", `code="INVALID_ARGUMENT"`)
	internalBefore := s.logs.finished("<nil>", "INTERNAL") + s.logs.finished("alpha", "INTERNAL")
	for _, b := range bodies {
		name, method, body := b.name, b.method, b.body
		a, err := postHTTP(ctx, s, method, []byte(body), "Content-Type", "application/json", "Authorization", "Bearer "+alphaToken)
		require.NoError(t, err)
		require.Equal(t, http.StatusBadRequest, a.status, "%s: %.300s", name, a.message)
		require.Equal(t, "invalid_argument", a.code, name)
		require.Equal(t, idemregv1.ReasonMalformedRequest, a.reason, name)
		require.Less(t, len(a.message), 1<<10, name)
		a, err = postHTTP(ctx, s, method, []byte(body), "Content-Type", "application/json")
		require.NoError(t, err)
		require.Equal(t, http.StatusUnauthorized, a.status, "%s without credentials", name)
	}
	require.Eventually(t, func() bool {
		lines := s.logs.finished("alpha", "INVALID_ARGUMENT") - linesBefore
		sampled := s.metric(t, "idemreg_access_log_sampled_out_total", `code="INVALID_ARGUMENT"`) - sampledBefore
		return float64(lines)+sampled >= float64(len(bodies))
	}, 20*time.Second, 50*time.Millisecond, "every refusal logged or counted as left out")
	require.Equal(t, internalBefore, s.logs.finished("<nil>", "INTERNAL")+s.logs.finished("alpha", "INTERNAL"), "no INTERNAL logged")
}

// emptyMessages (issue 35, weakness 2): calls with no request message,
// 150 on the HTTP API (empty gRPC-Web bodies) and 300 native HTTP/2
// streams whose HEADERS end them, as alpha. Bound: each is answered
// INVALID_ARGUMENT (grpc-status 3), never INTERNAL; the access log writes
// at most --refusal-log-rate lines a second for each (+1 per second
// boundary), at INFO. Before, the native streams were grpc-go's INTERNAL
// ("cardinality violation"), written before any handler ran, and 300
// calls wrote 300 ERROR lines.
func emptyMessages(t *testing.T, s *suite) {
	// web stays within alpha's refusal budget (--refusal-rate's burst):
	// beyond it serve holds each refusal a second.
	const web, calls = 150, 300
	ctx := t.Context()
	webBefore := s.logs.finished("alpha", "INVALID_ARGUMENT")
	internalBefore := s.logs.finished("alpha", "INTERNAL") + s.logs.finished("<nil>", "INTERNAL")
	start := time.Now()
	for range web {
		a, err := postHTTP(ctx, s, "Lookup", nil, "Content-Type", "application/grpc-web+proto", "Authorization", "Bearer "+alphaToken)
		require.NoError(t, err)
		require.Equal(t, "3", a.code, "%+v", a)
	}
	webLines := s.logs.finished("alpha", "INVALID_ARGUMENT") - webBefore
	nativeBefore := s.logs.finished("alpha", "INVALID_ARGUMENT")
	p := dialRaw(t, s.addr, true)
	block := headerBlock("/idemreg.v1.RegistryService/Claim", alphaToken, 0)
	var ids []uint32
	for range calls {
		id := p.next
		p.next += 2
		require.NoError(t, p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block, EndHeaders: true, EndStream: true}))
		ids = append(ids, id)
		if len(ids)%maxStreams == 0 {
			requireInvalid(t, p, ids[len(ids)-maxStreams:])
		}
	}
	requireInvalid(t, p, ids[len(ids)-len(ids)%maxStreams:])
	took := time.Since(start)
	bound := refusalLogRate * (int(took.Seconds()) + 2)
	native := s.logs.finished("alpha", "INVALID_ARGUMENT") - nativeBefore
	require.Equal(t, internalBefore, s.logs.finished("alpha", "INTERNAL")+s.logs.finished("<nil>", "INTERNAL"), "no INTERNAL logged")
	t.Logf("%d empty gRPC-Web calls and %d empty native streams in %v: %d and %d access log lines (bound %d each)",
		web, calls, took.Round(time.Millisecond), webLines, native, bound)
	require.LessOrEqual(t, webLines, bound, "the HTTP API's refusals are sampled")
	require.LessOrEqual(t, native, bound, "the native streams' lines are sampled")
}

// requireInvalid awaits the streams ids of p, each answered
// INVALID_ARGUMENT.
func requireInvalid(t *testing.T, p *rawPeer, ids []uint32) {
	t.Helper()
	answers, codesOf := p.await(ids, 30*time.Second)
	require.Equal(t, len(ids), count(answers, answerStatus), "every stream answered")
	for _, id := range ids {
		require.Equal(t, codes.InvalidArgument, codesOf[id], "stream %d", id)
	}
}
