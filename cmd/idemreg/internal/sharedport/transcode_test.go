package sharedport

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/httpserve"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/storage/pebble"
)

const apiToken = "sharedport-token-0123456789abcdef"

// apiServer is a real registry server (embedded store in memory) on a
// loopback port shared as serve shares it: gRPC, and the HTTP API.
type apiServer struct {
	base string
	logs *lines
	srv  *server.Server
}

// lines keeps a server's JSON log lines.
type lines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// finished is the server's access log lines ("finished call") so far.
func (l *lines) finished(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(l.buf.Bytes()))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		var line map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &line))
		if line["msg"] == "finished call" {
			out = append(out, line)
		}
	}
	return out
}

// startAPI serves a registry whose one identity has apiToken, granted
// "billing.*", with refusal lines sampled at refusalLogRate a second.
func startAPI(t *testing.T, refusalLogRate int) *apiServer {
	t.Helper()
	return startAPIWith(t, func(c *server.Config) { c.RefusalLogRate = refusalLogRate })
}

// startAPIWith is startAPI with the server's config as configure leaves it.
func startAPIWith(t *testing.T, configure func(*server.Config)) *apiServer {
	t.Helper()
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	set, err := access.Parse([]byte(`
identities:
  - {name: billing, token_hashes: ["` + access.HashToken(apiToken) + `"], consumers: ["billing.*"]}
`))
	require.NoError(t, err)
	logs := &lines{}
	logger := slog.New(slog.NewJSONHandler(logs, nil))
	cfg := server.Config{Logger: logger, Access: set}
	configure(&cfg)
	srv, err := server.New(store, cfg)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	grpcLis, httpLis := Split(lis, nil, time.Second, logger)
	stop, err := ServeAPI(srv.GRPCServer(), srv, srv.MaxRequestBytes(), httpLis, nil, nil, httpserve.DefaultBounds(), logger)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, grpcLis) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		stop()
	})
	return &apiServer{base: "http://" + lis.Addr().String(), logs: logs, srv: srv}
}

// answer is what the HTTP API answered a call: the Connect error (code,
// message, ErrorInfo) or gRPC-Web's status.
type answer struct {
	status  int
	code    string // Connect's code, or gRPC-Web's grpc-status
	message string
	info    *errdetails.ErrorInfo
}

// call POSTs body to a RegistryService method with the token and the
// headers given (an empty value removes the header), and reads the answer.
func (s *apiServer) call(t *testing.T, method string, body io.Reader, header ...string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.base+"/idemreg.v1.RegistryService/"+method, body)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+apiToken)
	for i := 0; i+1 < len(header); i += 2 {
		if header[i+1] == "" {
			req.Header.Del(header[i]) // without credentials
			continue
		}
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	a := answer{status: res.StatusCode}
	if strings.HasPrefix(res.Header.Get("Content-Type"), "application/grpc-web") {
		// The status is in the headers (no message) or in the trailers frame.
		a.code, a.message = res.Header.Get("Grpc-Status"), res.Header.Get("Grpc-Message")
		details := res.Header.Get("Grpc-Status-Details-Bin")
		for len(b) >= 5 {
			n := binary.BigEndian.Uint32(b[1:5])
			if b[0]&0x80 != 0 {
				for l := range strings.SplitSeq(string(b[5:5+n]), "\r\n") {
					k, v, _ := strings.Cut(l, ":")
					switch strings.ToLower(k) {
					case "grpc-status":
						a.code = strings.TrimSpace(v)
					case "grpc-message":
						a.message = strings.TrimSpace(v)
					case "grpc-status-details-bin":
						details = strings.TrimSpace(v)
					}
				}
			}
			b = b[5+n:]
		}
		if details != "" {
			raw, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(details, "="))
			require.NoError(t, err)
			a.info = errorInfoOf(t, raw)
		}
		return a
	}
	var ce struct {
		Code, Message string
		Details       []struct{ Type, Value string }
	}
	if res.StatusCode != http.StatusOK {
		require.NoError(t, json.Unmarshal(b, &ce), "%.300s", b)
	}
	a.code, a.message = ce.Code, ce.Message
	for _, d := range ce.Details {
		if d.Type == "google.rpc.ErrorInfo" {
			raw, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(d.Value, "="))
			require.NoError(t, err)
			a.info = &errdetails.ErrorInfo{}
			require.NoError(t, proto.Unmarshal(raw, a.info))
		}
	}
	return a
}

// errorInfoOf is the ErrorInfo of an encoded google.rpc.Status.
func errorInfoOf(t *testing.T, raw []byte) *errdetails.ErrorInfo {
	t.Helper()
	var st spb.Status
	require.NoError(t, proto.Unmarshal(raw, &st))
	for _, d := range st.GetDetails() {
		info := &errdetails.ErrorInfo{}
		if d.MessageIs(info) {
			require.NoError(t, d.UnmarshalTo(info))
			return info
		}
	}
	return nil
}

// gzipped is b compressed.
func gzipped(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	require.NoError(t, err)
	_, err = w.Write(b)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	return buf.Bytes()
}

// webFrame is a gRPC-Web message frame.
func webFrame(compressed bool, msg []byte) []byte {
	flag := byte(0)
	if compressed {
		flag = 1
	}
	return append(binary.BigEndian.AppendUint32([]byte{flag}, uint32(len(msg))), msg...)
}

// TestHTTPAPIRequestBounds: a request that inflates, or arrives, beyond
// the server's receive limit (5 MiB) is answered INVALID_ARGUMENT with
// ErrorInfo MALFORMED_REQUEST before it is decoded, whatever the protocol
// and the encoding; the inflation stops at the limit. The refusal is the
// server's, after authentication (the ErrorInfo names the message, the
// access log has the identity's line), so that the caller's refusal
// budget holds it. Before, vanguard inflated a 64 MiB gzip bomb whole,
// then decoded it, and answered INTERNAL or unknown (500); then it
// answered a bomb itself, before authentication, outside any budget.
func TestHTTPAPIRequestBounds(t *testing.T) {
	s := startAPI(t, 0)
	const inflated = 64 << 20
	key := strings.Repeat("k", inflated)
	jsonBomb := gzipped(t, []byte(`{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"`+key+`"}`))
	pb, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: key})
	require.NoError(t, err)
	protoBomb := gzipped(t, pb)
	key = ""
	pb = nil
	t.Logf("JSON bomb %d KiB, proto bomb %d KiB, each inflating to %d MiB", len(jsonBomb)>>10, len(protoBomb)>>10, inflated>>20)
	big := bytes.Repeat([]byte("k"), 8<<20)
	for _, tc := range []struct {
		name   string
		body   func() io.Reader
		header []string
		web    bool
		// maxAlloc bounds what this process allocates meanwhile, client
		// and server: a bomb is refused before any of it is kept
		// (inflating it whole allocated twice its size); 8 MiB sent is
		// read to the bound, into vanguard's buffer, growing by doubling.
		maxAlloc uint64
	}{
		{"Connect JSON, gzip", func() io.Reader { return bytes.NewReader(jsonBomb) },
			[]string{"Content-Type", "application/json", "Content-Encoding", "gzip"}, false, 4 << 20},
		{"Connect proto, gzip", func() io.Reader { return bytes.NewReader(protoBomb) },
			[]string{"Content-Type", "application/proto", "Connect-Protocol-Version", "1", "Content-Encoding", "gzip"}, false, 4 << 20},
		{"gRPC-Web, gzip message", func() io.Reader { return bytes.NewReader(webFrame(true, protoBomb)) },
			[]string{"Content-Type", "application/grpc-web+proto", "Grpc-Encoding", "gzip"}, true, 4 << 20},
		{"Connect JSON, 8 MiB without a length", func() io.Reader { return io.MultiReader(strings.NewReader(`{"key":"`), bytes.NewReader(big)) },
			[]string{"Content-Type", "application/json"}, false, 48 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			a := s.call(t, "Claim", tc.body(), tc.header...)
			runtime.ReadMemStats(&after)
			if tc.web {
				require.Equal(t, http.StatusOK, a.status)
				require.Equal(t, "3", a.code, "INVALID_ARGUMENT: %s", a.message)
			} else {
				require.Equal(t, http.StatusBadRequest, a.status, "%+v", a)
				require.Equal(t, "invalid_argument", a.code, "%+v", a)
			}
			require.NotNil(t, a.info, "an ErrorInfo: %+v", a)
			require.Equal(t, idemregv1.ReasonMalformedRequest, a.info.GetReason())
			require.Contains(t, a.message, "larger than the")
			require.Equal(t, "idemreg.v1.ClaimRequest", a.info.GetMetadata()["message"], "the server's refusal: %+v", a)
			allocated := after.TotalAlloc - before.TotalAlloc
			t.Logf("allocated %d KiB", allocated>>10)
			require.Less(t, allocated, tc.maxAlloc)
		})
	}
	t.Run("compressed under the limit", func(t *testing.T) {
		for _, tc := range []struct{ typ, body string }{
			{"application/json", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"gz-json"}`},
		} {
			a := s.call(t, "Claim", bytes.NewReader(gzipped(t, []byte(tc.body))), "Content-Type", tc.typ, "Content-Encoding", "gzip")
			require.Equal(t, http.StatusOK, a.status, "%+v", a)
		}
		msg, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "gz-web"})
		require.NoError(t, err)
		a := s.call(t, "Claim", bytes.NewReader(webFrame(true, gzipped(t, msg))), "Content-Type", "application/grpc-web+proto", "Grpc-Encoding", "gzip")
		require.Equal(t, "0", a.code, "%+v", a)
	})
	require.Eventually(t, func() bool {
		var refused int
		for _, line := range s.logs.finished(t) {
			if line["grpc.code"] == "INVALID_ARGUMENT" && line["identity"] == "billing" {
				refused++
			}
		}
		return refused == 4
	}, 10*time.Second, 10*time.Millisecond, "each refusal is the server's, with its access log line")
}

// countingBody counts what is read of a request's body.
type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// TestHTTPAPIUnknownCallerBodyUnread: a call without credentials, or with
// a token no identity has, is answered UNAUTHENTICATED (401) by the
// server's chain, its access log line written, without a byte of its
// body read: a gzip bomb (64 KiB inflating to 64 MiB) costs an anonymous
// peer's target nothing to inflate. Before, the transcoder read and inflated the whole body
// (5 MiB of it, to count it) before the server refused the caller.
func TestHTTPAPIUnknownCallerBodyUnread(t *testing.T) {
	s := startAPI(t, 0)
	const inflated = 64 << 20
	pb, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: strings.Repeat("k", inflated)})
	require.NoError(t, err)
	bomb := gzipped(t, pb)
	pb = nil
	t.Logf("bomb %d KiB, inflating to %d MiB", len(bomb)>>10, inflated>>20)

	// The real transcoder over s's server, on a listener of its own whose
	// handler counts what the transcoder reads of each body.
	h, err := transcoder(s.srv.GRPCServer(), s.srv, s.srv.MaxRequestBytes())
	require.NoError(t, err)
	var read atomic.Int64
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{Handler: boundBody(s.srv.MaxRequestBytes(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = countingBody{r.Body, &read}
		h.ServeHTTP(w, r)
	}))}
	go func() { _ = hs.Serve(lis) }()
	t.Cleanup(func() { _ = hs.Close() })
	counted := &apiServer{base: "http://" + lis.Addr().String(), logs: s.logs}

	for _, tc := range []struct {
		name   string
		body   []byte
		header []string
		web    bool
	}{
		{"Connect proto", bomb, []string{"Content-Type", "application/proto", "Connect-Protocol-Version", "1", "Content-Encoding", "gzip"}, false},
		{"gRPC-Web", webFrame(true, bomb), []string{"Content-Type", "application/grpc-web+proto", "Grpc-Encoding", "gzip"}, true},
		{"Connect proto, unknown token", bomb, []string{"Content-Type", "application/proto", "Connect-Protocol-Version", "1", "Content-Encoding", "gzip",
			"Authorization", "Bearer not-a-token"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			read.Store(0)
			a := counted.call(t, "Claim", bytes.NewReader(tc.body), append([]string{"Authorization", ""}, tc.header...)...)
			if tc.web {
				require.Equal(t, "16", a.code, "UNAUTHENTICATED: %+v", a)
			} else {
				require.Equal(t, http.StatusUnauthorized, a.status, "%+v", a)
				require.Equal(t, "unauthenticated", a.code, "%+v", a)
			}
			require.Zero(t, read.Load(), "bytes of the body read")
		})
	}
	// The line is written once the status is sent, after the answer.
	require.Eventually(t, func() bool {
		var lines int
		for _, line := range s.logs.finished(t) {
			if line["grpc.code"] == "UNAUTHENTICATED" {
				lines++
			}
		}
		return lines == 3
	}, 10*time.Second, 10*time.Millisecond, "each refusal is the server's, with its access log line")

	// A known caller's is read as before.
	read.Store(0)
	msg, err := proto.Marshal(&idemregv1.ClaimRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "known"})
	require.NoError(t, err)
	a := counted.call(t, "Claim", bytes.NewReader(msg), "Content-Type", "application/proto", "Connect-Protocol-Version", "1")
	require.Equal(t, http.StatusOK, a.status, "%+v", a)
	require.Equal(t, int64(len(msg)), read.Load())
}

// TestHTTPAPIUnknownCallerBodyCosts: what an unknown caller sends costs
// its source's refusal budget a refusal per 16 KiB, though none of it is
// read: with a budget of 10 a second (burst 20), a 256 KiB body (17) is
// answered at once, and the next is held. Counted in calls (1 each), a
// loop of 256 KiB bodies was held only at the budget's rate of calls.
func TestHTTPAPIUnknownCallerBodyCosts(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := startAPIWith(t, func(c *server.Config) {
		c.RefusalRate, c.RefusalDelay = 10, time.Minute
		c.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	})
	held := func() int64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(t.Context(), &rm))
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == server.MetricRefusalsHeld {
					var n int64
					for _, dp := range d.DataPoints {
						n += dp.Value
					}
					return n
				}
			}
		}
		return 0
	}
	body := bytes.Repeat([]byte{1}, 256<<10)
	headers := []string{"Authorization", "", "Content-Type", "application/proto", "Connect-Protocol-Version", "1"}
	a := s.call(t, "Claim", bytes.NewReader(body), headers...)
	require.Equal(t, http.StatusUnauthorized, a.status, "%+v", a)
	require.Zero(t, held(), "the first, within the budget, is answered at once")

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+"/idemreg.v1.RegistryService/Claim", bytes.NewReader(body))
		if err == nil {
			req.Header.Set("Content-Type", "application/proto")
			req.Header.Set("Connect-Protocol-Version", "1")
			var res *http.Response
			if res, err = http.DefaultClient.Do(req); err == nil {
				_ = res.Body.Close()
			}
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return held() == 1 }, 20*time.Second, 5*time.Millisecond, "the second is held")
	select {
	case err := <-done:
		t.Fatalf("answered while held: %v", err)
	default:
	}
}

// TestHTTPAPIBadJSON: JSON that does not decode into the request is the
// caller's mistake: 400, invalid_argument, ErrorInfo MALFORMED_REQUEST,
// quoting at most 256 bytes of the decoder's error, refused after
// authentication (no credentials: unauthenticated), and logged like any
// refusal. Before, vanguard answered it 500 "unknown", echoing a 1 MB
// value whole, with no ErrorInfo, and the server logged an ERROR.
func TestHTTPAPIBadJSON(t *testing.T) {
	s := startAPI(t, 0)
	for _, tc := range []struct{ name, method, body string }{
		{"broken", "Claim", `{"consumer":`},
		{"duration in hours", "Claim", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"k","lease":"1h"}`},
		{"int64 overflow", "Complete", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"k","token":"99999999999999999999999"}`},
		{"unknown enum number", "Claim", `{"consumer":"billing.worker","kind":99999999999,"key":"k"}`},
		{"1 MB value", "Claim", `{"consumer":"billing.worker","kind":"KIND_MESSAGE","key":"k","lease":"` + strings.Repeat("9", 1<<20) + `"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := s.call(t, tc.method, strings.NewReader(tc.body), "Content-Type", "application/json")
			require.Equal(t, http.StatusBadRequest, a.status, "%.300s", a.message)
			require.Equal(t, "invalid_argument", a.code)
			require.NotNil(t, a.info, "an ErrorInfo")
			require.Equal(t, idemregv1.ReasonMalformedRequest, a.info.GetReason())
			require.Equal(t, "idemreg.v1."+tc.method+"Request", a.info.GetMetadata()["message"])
			require.Less(t, len(a.message), 512, a.message)
		})
	}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.base+"/idemreg.v1.RegistryService/Claim", strings.NewReader(`{"consumer":`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusUnauthorized, res.StatusCode, "authentication first")

	var refused int
	for _, line := range s.logs.finished(t) {
		require.NotEqual(t, "INTERNAL", line["grpc.code"], "%v", line)
		if line["grpc.code"] == "INVALID_ARGUMENT" && line["identity"] == "billing" {
			refused++
			require.Equal(t, "INFO", line["level"])
			require.Less(t, len(line["grpc.error"].(string)), 512)
		}
	}
	require.Equal(t, 5, refused, "each refusal has its access log line")
}

// TestHTTPAPIEmptyMessage: a call with no request message (an empty
// gRPC-Web or Connect body) is INVALID_ARGUMENT, MALFORMED_REQUEST, after
// authentication, its line INFO and sampled. Before, grpc-go answered it
// INTERNAL "cardinality violation", and the server logged an ERROR line
// for every one.
func TestHTTPAPIEmptyMessage(t *testing.T) {
	const rate = 3
	s := startAPI(t, rate)
	web := s.call(t, "Claim", http.NoBody, "Content-Type", "application/grpc-web+proto")
	require.Equal(t, "3", web.code, "INVALID_ARGUMENT: %s", web.message)
	require.NotNil(t, web.info)
	require.Equal(t, idemregv1.ReasonMalformedRequest, web.info.GetReason())
	connectJSON := s.call(t, "Claim", http.NoBody, "Content-Type", "application/json")
	require.Equal(t, http.StatusBadRequest, connectJSON.status)
	require.Equal(t, "invalid_argument", connectJSON.code)
	require.Equal(t, idemregv1.ReasonMalformedRequest, connectJSON.info.GetReason())

	// Two messages where one is required: malformed too.
	msg, err := proto.Marshal(&idemregv1.LookupRequest{Consumer: "billing.worker", Kind: idemregv1.Kind_KIND_MESSAGE, Key: "k"})
	require.NoError(t, err)
	two := s.call(t, "Lookup", bytes.NewReader(append(webFrame(false, msg), webFrame(false, msg)...)), "Content-Type", "application/grpc-web+proto")
	require.Equal(t, "3", two.code, "INVALID_ARGUMENT: %s", two.message)
	require.Equal(t, idemregv1.ReasonMalformedRequest, two.info.GetReason())

	for range 100 {
		a := s.call(t, "Lookup", http.NoBody, "Content-Type", "application/grpc-web+proto")
		require.Equal(t, "3", a.code)
	}
	var lookups int
	for _, line := range s.logs.finished(t) {
		require.NotEqual(t, "INTERNAL", line["grpc.code"], "%v", line)
		require.Equal(t, "INFO", line["level"], "%v", line)
		if line["grpc.method"] == "Lookup" {
			lookups++
		}
	}
	// 100 calls: at most rate lines a second of them.
	require.Less(t, lookups, 100, "the lines are sampled")
}
