package server_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/storage/postgres"
	"github.com/idemreg/idemreg/storage/postgres/pgtest"
)

// rawPeer is an HTTP/2 client that ignores what the server's SETTINGS ask
// (header list size, concurrent streams), as an abusive peer would; a gRPC
// client would refuse to send what these tests send.
type rawPeer struct {
	conn net.Conn
	fr   *http2.Framer
	next uint32
}

func dialRaw(t testing.TB, addr string) *rawPeer {
	t.Helper()
	return dialRawFrom(t, addr, "")
}

// dialRawFrom is dialRaw from the loopback address ip ("" for the
// system's choice), so that the server sees another source: a listener
// that holds one source to a share of its connections (the health
// listener's MaxHealthConnectionsPerSource) takes the connections of
// several.
func dialRawFrom(t testing.TB, addr, ip string) *rawPeer {
	t.Helper()
	d := net.Dialer{}
	if ip != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(ip)}
	}
	c, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := &rawPeer{conn: c, fr: http2.NewFramer(c, c), next: 1}
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	_, err = c.Write([]byte(http2.ClientPreface))
	require.NoError(t, err)
	require.NoError(t, p.fr.WriteSettings())
	return p
}

// open starts a call of method with pad bytes of extra headers (in fields
// of 4 KiB, none indexed, so they arrive at full size) and, when withBody,
// an empty request message that ends the client's side.
func (p *rawPeer) open(method string, pad int, withBody bool) (uint32, error) {
	return p.openFields(method, pad, 4<<10, withBody)
}

// openFields is open with pad in fields of field bytes: small fields cost
// the server more per byte (a string and a map entry each).
func (p *rawPeer) openFields(method string, pad, field int, withBody bool) (uint32, error) {
	var block []byte
	buf := &appendWriter{&block}
	enc := hpack.NewEncoder(buf)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "idemreg"},
		{"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		if err := enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}); err != nil {
			return 0, err
		}
	}
	for i := 0; pad > 0; i++ {
		n := min(pad, field)
		pad -= n
		if err := enc.WriteField(hpack.HeaderField{Name: "x-pad-" + strconv.Itoa(i), Value: randomText(n), Sensitive: true}); err != nil {
			return 0, err
		}
	}
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
	if withBody {
		// An empty message: no compression, length 0.
		if err := p.fr.WriteData(id, true, make([]byte, 5)); err != nil {
			return 0, err
		}
	}
	return id, nil
}

// answer is what became of one stream.
type answer string

const (
	answerServed    answer = "served"  // a response message came
	answerReset     answer = "reset"   // RST_STREAM: refused by the transport
	answerConnGone  answer = "closed"  // the connection went away
	answerPending   answer = "pending" // nothing yet
	answerGRPCError answer = "status"  // a gRPC error status
)

// await reads until every stream of ids has an answer, and returns them
// with the gRPC codes of the error statuses. The read deadline is only a
// guard against a hang.
func (p *rawPeer) await(ids []uint32) (map[uint32]answer, map[uint32]codes.Code) {
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
	_ = p.conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	for pending > 0 {
		f, err := p.fr.ReadFrame()
		if err != nil {
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
			settle(f.StreamID, answerReset)
		case *http2.DataFrame:
			settle(f.StreamID, answerServed)
		case *http2.MetaHeadersFrame:
			if v := f.PseudoValue("status"); v != "" && v != "200" {
				settle(f.StreamID, answerGRPCError)
			}
			for _, hf := range f.RegularFields() {
				if hf.Name == "grpc-status" {
					n, _ := strconv.Atoi(hf.Value)
					codesOf[f.StreamID] = codes.Code(n)
					if n == 0 {
						settle(f.StreamID, answerServed)
					} else {
						settle(f.StreamID, answerGRPCError)
					}
				}
			}
		case *http2.GoAwayFrame:
			for _, id := range ids {
				if id > f.LastStreamID {
					settle(id, answerConnGone)
				}
			}
		}
	}
	return answers, codesOf
}

// resetsBefore sends a PING and reads until its acknowledgement, and
// returns the streams reset before it (true: REFUSED_STREAM) or answered
// at once with a status (false). The server answers frames in the
// order they came, so a stream it refused on arrival is reset by then;
// streams it accepted and holds (waiting for a request that never comes)
// get nothing.
func (p *rawPeer) resetsBefore() (map[uint32]bool, error) {
	data := [8]byte{'b', 'o', 'u', 'n', 'd', 's'}
	if err := p.fr.WritePing(false, data); err != nil {
		return nil, err
	}
	_ = p.conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	reset := map[uint32]bool{}
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			return reset, err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = p.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if f.IsAck() && f.Data == data {
				return reset, nil
			}
		case *http2.RSTStreamFrame:
			reset[f.StreamID] = f.ErrCode == http2.ErrCodeRefusedStream
		case *http2.MetaHeadersFrame:
			if f.StreamEnded() { // a status at once: refused by a tap
				reset[f.StreamID] = false
			}
		}
	}
}

type appendWriter struct{ b *[]byte }

func (w *appendWriter) Write(p []byte) (int, error) { *w.b = append(*w.b, p...); return len(p), nil }

func randomText(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

func count(answers map[uint32]answer, want answer) int {
	n := 0
	for _, a := range answers {
		if a == want {
			n++
		}
	}
	return n
}

// heapInUse is the heap in use after a collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

const watchMethod = "/grpc.health.v1.Health/Watch"

// TestAnonymousPeersCannotExhaustMemory attacks a real server, on its gRPC
// listener and its health listener at once, the way the issue measured it
// (health Watch streams with megabytes of headers), and with more streams
// per connection and more Watch streams than the bounds allow, all held
// open; the heap must stay within a few MiB of where it was, and each kind
// of excess must be refused by the bound made for it. Without the bounds
// the same attack pins the attack's size (64 MiB of headers) in the heap.
func TestAnonymousPeersCannotExhaustMemory(t *testing.T) {
	bounds := server.DefaultBounds()
	srv, err := server.New(memStore(t), server.Config{HealthInterval: time.Hour, Bounds: bounds})
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	healthDone := make(chan error, 1)
	go func() { healthDone <- srv.ServeHealth(hlis) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, <-healthDone)
	})
	addrs := []string{lis.Addr().String(), hlis.Addr().String()}
	for _, addr := range addrs { // both serve before the baseline is taken
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		_, err = healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: server.LivenessService})
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	}
	before := heapInUse()

	const (
		bigConns, bigStreams, bigHeaders = 4, 16, 512 << 10 // per listener: 32 MiB of headers
		heldConns, heldHeaders           = 2, 8 << 10       // under the header bound
		watchConns, watchStreams         = 2, 40            // under the stream bound
	)
	// A connection's stream bound: the health listener's is
	// HealthMaxConcurrentStreams.
	streamBound := map[string]int{addrs[0]: int(bounds.MaxConcurrentStreams), addrs[1]: server.HealthMaxConcurrentStreams}
	type result struct {
		kind     string
		answers  map[uint32]answer
		codes    map[uint32]codes.Code
		refused  int // streams reset with REFUSED_STREAM
		syncErr  error
		accepted int
		bound    int // the connection's stream bound
	}
	watchStreamsSent := 0
	results := make(chan result, len(addrs)*(bigConns+heldConns+watchConns))
	var wg sync.WaitGroup
	// open starts the streams; a connection the server closed refuses
	// what was not sent.
	open := func(p *rawPeer, method string, streams, pad int, withBody bool) (ids []uint32, unsent int) {
		for i := range streams {
			id, err := p.open(method, pad, withBody)
			if err != nil {
				return ids, streams - i
			}
			ids = append(ids, id)
		}
		return ids, 0
	}
	for _, addr := range addrs {
		for range bigConns {
			p := dialRaw(t, addr)
			wg.Go(func() {
				ids, unsent := open(p, watchMethod, bigStreams, bigHeaders, false)
				a, c := p.await(ids)
				for i := range unsent {
					a[uint32(1<<30+i)] = answerConnGone
				}
				results <- result{kind: "big headers", answers: a, codes: c}
			})
		}
		bound := streamBound[addr]
		for range heldConns {
			// Unary calls whose request never comes: held open.
			p := dialRaw(t, addr)
			wg.Go(func() {
				ids, _ := open(p, "/grpc.health.v1.Health/Check", bound+16, heldHeaders, false)
				reset, err := p.resetsBefore()
				refused := 0
				for _, r := range reset {
					if r {
						refused++
					}
				}
				results <- result{kind: "held", refused: refused, accepted: len(ids) - len(reset), syncErr: err, bound: bound}
			})
		}
		streams := min(watchStreams, bound)
		watchStreamsSent += watchConns * streams
		for range watchConns {
			p := dialRaw(t, addr)
			wg.Go(func() {
				ids, _ := open(p, watchMethod, streams, 0, true)
				a, c := p.await(ids)
				results <- result{kind: "watch", answers: a, codes: c}
			})
		}
	}
	wg.Wait()
	close(results)
	// Measured while every connection and every accepted stream is open.
	after := heapInUse()
	grown := int64(after) - int64(before)
	t.Logf("heap in use: %d MiB before, %d MiB under attack", before>>20, after>>20)
	require.Less(t, grown, int64(16<<20), "the heap grew by %d MiB under the attack", grown>>20)

	served, tooMany := 0, 0
	for r := range results {
		switch r.kind {
		case "big headers":
			require.Zero(t, count(r.answers, answerServed), "a stream over the header bound was served")
			require.Equal(t, bigStreams, count(r.answers, answerReset)+count(r.answers, answerConnGone), "%v", r.answers)
		case "held":
			require.NoError(t, r.syncErr)
			require.Equal(t, 16, r.refused, "streams beyond the per-connection bound are refused")
			require.Equal(t, r.bound, r.accepted)
		case "watch":
			require.Zero(t, count(r.answers, answerReset), "%v", r.answers)
			served += count(r.answers, answerServed)
			for id, a := range r.answers {
				if a == answerGRPCError {
					require.Equal(t, codes.ResourceExhausted, r.codes[id])
					tooMany++
				}
			}
		}
	}
	require.Equal(t, bounds.MaxPublicStreams, served, "Watch streams are served up to the bound, over both listeners")
	require.Equal(t, watchStreamsSent-bounds.MaxPublicStreams, tooMany,
		"the other Watch streams fail at once with RESOURCE_EXHAUSTED")
}

// TestPublicStreamBound: beyond MaxPublicStreams, a health Watch or a
// reflection stream fails with RESOURCE_EXHAUSTED, reason
// TOO_MANY_STREAMS, and a slot freed is taken again; headers over the
// bound are refused to a well-behaved client too.
func TestPublicStreamBound(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	conn := start(t, memStore(t), server.Config{Bounds: server.Bounds{MaxPublicStreams: 2}, MeterProvider: mp})
	hc := healthpb.NewHealthClient(conn)
	watch := func(ctx context.Context) error {
		w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: server.LivenessService})
		if err != nil {
			return err
		}
		_, err = w.Recv()
		return err
	}
	ctx1, cancel1 := context.WithCancel(t.Context())
	defer cancel1()
	require.NoError(t, watch(ctx1))
	require.NoError(t, watch(t.Context()))
	err := watch(t.Context())
	requireStatus(t, err, codes.ResourceExhausted, idemregv1.ReasonTooManyStreams)

	sums := collectSums(t, reader)
	require.EqualValues(t, 1, sums[server.MetricBoundRefused+" bound=public_streams"], "%v", sums)
	require.EqualValues(t, 1, sums[server.MetricConnections+" listener=grpc"], "the test's one connection; %v", sums)

	cancel1()
	require.Eventually(t, func() bool { return watch(t.Context()) == nil }, 10*time.Second, 10*time.Millisecond,
		"a Watch that ends frees its slot")

	// Unary health checks are not streams: they stay open to probes.
	_, err = hc.Check(t.Context(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)

	big := metadata.AppendToOutgoingContext(t.Context(), "x-pad", randomText(server.DefaultMaxHeaderListSize))
	_, err = hc.Check(big, &healthpb.HealthCheckRequest{})
	require.Error(t, err, "headers over the bound are refused")
}

func TestBoundsValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		bounds server.Bounds
		err    string
	}{
		{name: "zero takes the defaults", bounds: server.Bounds{}},
		{name: "defaults", bounds: server.DefaultBounds()},
		{name: "header list too small", bounds: server.Bounds{MaxHeaderListSize: 512}, err: "header list bound"},
		{name: "header list no bound", bounds: server.Bounds{MaxHeaderListSize: 32 << 20}, err: "header list bound"},
		{name: "negative connections", bounds: server.Bounds{MaxConnections: -1}, err: "connection bound"},
		{name: "negative public streams", bounds: server.Bounds{MaxPublicStreams: -1}, err: "without credentials"},
		{name: "negative calls per identity", bounds: server.Bounds{MaxCallsPerIdentity: -1}, err: "one identity's calls"},
		{name: "negative pending calls", bounds: server.Bounds{MaxPendingCalls: -1}, err: "waiting for their request"},
		{name: "one pending call for two listeners", bounds: server.Bounds{MaxPendingCalls: 1}, err: "waiting for their request"},
		{name: "negative handshake timeout", bounds: server.Bounds{ConnectionTimeout: -time.Second}, err: "handshake"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.bounds.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
			_, err = server.New(memStore(t), server.Config{Bounds: tc.bounds})
			require.ErrorContains(t, err, tc.err, "New refuses it too")
		})
	}
}

// TestCallsPerIdentity holds calls of one identity in progress on a real
// PostgreSQL (its table locked by another session): beyond the bound the
// identity's next call fails at once with TOO_MANY_CALLS, another
// identity's calls are not refused, and the slots come back when the calls
// end.
func TestCallsPerIdentity(t *testing.T) {
	dbURL := pgtest.NewDatabase(t)
	store, err := postgres.Open(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	const billingToken, ordersToken = "billing-token-0123456789abcdef", "orders-token-0123456789abcdef"
	src := accessFile(t, `
identities:
  - name: billing
    token_hashes: ["`+access.HashToken(billingToken)+`"]
    consumers: ["billing.*"]
  - name: orders
    token_hashes: ["`+access.HashToken(ordersToken)+`"]
    consumers: ["orders.*"]
`)
	// The health loop's probe would wait for the lock too: it runs once,
	// at start.
	reader := sdkmetric.NewManualReader()
	conn := start(t, store, server.Config{Access: src, Bounds: server.Bounds{MaxCallsPerIdentity: 2}, HealthInterval: time.Hour,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	c := idemregv1.NewRegistryServiceClient(conn)
	lookup := func(ctx context.Context, token, consumer string) error {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
		_, err := c.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: "m-1"})
		return err
	}
	requireStatus(t, lookup(t.Context(), billingToken, "billing.worker"), codes.NotFound, idemregv1.ReasonNotFound)

	locker, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = locker.Close(context.Background()) })
	pgtest.RequirePostgreSQL(t, dbURL, "it takes LOCK TABLE and watches pg_stat_activity's lock waits")
	admin, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	tx, err := locker.Begin(t.Context())
	require.NoError(t, err)
	_, err = tx.Exec(t.Context(), `LOCK TABLE idemreg_records IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	held := make(chan error, 2)
	for range 2 {
		go func() {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			held <- lookup(ctx, billingToken, "billing.worker")
		}()
	}
	// Both are in progress once both wait for the lock in PostgreSQL.
	require.Eventually(t, func() bool {
		var waiting int
		err := admin.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		require.NoError(t, err)
		return waiting == 2
	}, 20*time.Second, time.Millisecond)
	short := func(token, consumer string) error {
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		return lookup(ctx, token, consumer)
	}
	st := requireStatus(t, short(billingToken, "billing.worker"), codes.ResourceExhausted, idemregv1.ReasonTooManyCalls)
	require.Contains(t, st.Message(), `"billing"`)
	sums := collectSums(t, reader)
	require.EqualValues(t, 1, sums[server.MetricBoundRefused+" bound=identity_calls identity=billing"], "%v", sums)
	require.NotEqual(t, codes.ResourceExhausted, statusCode(short(ordersToken, "orders.inbox")),
		"orders is not held to billing's bound (its call waits for the lock like any other)")

	require.NoError(t, tx.Commit(t.Context()))
	for range 2 {
		requireStatus(t, <-held, codes.NotFound, idemregv1.ReasonNotFound)
	}
	for range 3 {
		requireStatus(t, lookup(t.Context(), billingToken, "billing.worker"), codes.NotFound, idemregv1.ReasonNotFound)
	}
}

// collectSums reads the integer sums and gauges of reader, keyed by name
// and attributes ("name k=v ...").
func collectSums(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	sums := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range d.DataPoints {
					key := m.Name
					for _, kv := range dp.Attributes.ToSlice() {
						key += " " + string(kv.Key) + "=" + kv.Value.Emit()
					}
					sums[key] += dp.Value
				}
			}
		}
	}
	return sums
}
