package adversarial

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/internal/servetest"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/access"
)

// The bounds the suite starts serve with. They are smaller than the
// defaults where a default would make an attack take minutes to reach
// its bound; each case says which one it measures.
const (
	maxConnections = 32 // --max-connections, per listener
	// httpMaxConnections is --http-max-connections: each HTTP listener's
	// (metrics, the HTTP API) cap on open connections.
	httpMaxConnections = 16
	// maxPendingCalls is --max-pending-calls: calls whose message has not
	// arrived, half of them per gRPC listener.
	maxPendingCalls = server.DefaultMaxPendingCalls
	// raceShadow is how much more memory the -race binary takes than the
	// plain one for the same goroutines and buffers (the race detector's
	// shadow memory, two to eight times).
	raceShadow        = 8
	maxStreams        = 64              // --max-concurrent-streams (the default)
	maxHeaderList     = 16 << 10        // --max-header-list-size (the default)
	connectionTimeout = 2 * time.Second // --connection-timeout
	maxWaiters        = 100             // --max-waiters; half of it per identity
	maxQuotaConsumers = 50              // --max-quota-consumers-per-identity
	refusalLogRate    = 5               // --refusal-log-rate, lines a second per identity and code
)

// The two tenants of the config file, each granted its own prefix, and
// the quotas the quota cases run against.
const (
	alphaToken = "alpha-token-0123456789abcdef0123456789"
	betaToken  = "beta-token-0123456789abcdef0123456789"
	// alpha.quota: finding 5's race of concurrent batches.
	quotaRecords = 100
	// Every consumer under alpha.q. and under beta.q. has a quota of
	// its own, so each is followed (finding 2).
	alphaPrefixQuota = 5
	betaPrefixQuota  = 3
)

var configDoc = `
identities:
  - name: alpha
    token_hashes: ["` + access.HashToken(alphaToken) + `"]
    consumers: ["alpha.*"]
    admin: ["alpha.*"]
  - name: beta
    token_hashes: ["` + access.HashToken(betaToken) + `"]
    consumers: ["beta.*"]
    admin: ["beta.*"]
consumers:
  - {name: alpha.quota, max_records: ` + strconv.Itoa(quotaRecords) + `}
  - {prefix: alpha.q., max_records: ` + strconv.Itoa(alphaPrefixQuota) + `}
  - {prefix: beta.q., max_records: ` + strconv.Itoa(betaPrefixQuota) + `}
# The identities' default rate (2000/s, burst 4000) is lifted so that the
# bounds each case measures are reached, not the rate limit first.
rate_limits:
  - identities: ["alpha", "beta"]
    rate: 1000000
    burst: 1000000
`

func TestMain(m *testing.M) { servetest.Main(m) }

// logs keeps what the cases ask about serve's log lines, as they come (a
// reader that fell behind would block the server on its stderr): the
// access log lines counted by identity and code, and the data races and
// panics, which fail the suite.
type logs struct {
	mu       sync.Mutex
	calls    map[string]int // "identity code" → finished calls logged
	msgs     map[string]int // message → lines
	problems []string
}

func newLogs() *logs { return &logs{calls: map[string]int{}, msgs: map[string]int{}} }

// observe counts one line (its JSON nil when it is not JSON): the
// servetest.Options.Observe of the suite's serves.
func (l *logs) observe(text string, line map[string]any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	msg, _ := line["msg"].(string)
	l.msgs[msg]++
	if msg == "finished call" {
		l.calls[fmt.Sprintf("%v %v", line["identity"], line["grpc.code"])]++
	}
	if strings.Contains(text, "DATA RACE") || msg == "panic recovered" || (line == nil && strings.HasPrefix(text, "panic:")) {
		l.problems = append(l.problems, text)
	}
}

// waitServing waits until serve p, whose lines l observes, logged that
// it serves.
func (l *logs) waitServing(t *testing.T, p *servetest.Process) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-p.Exited():
			t.Fatal("idemreg serve exited at start")
		default:
		}
		return l.lines("serving") > 0
	}, 60*time.Second, 20*time.Millisecond, "serve did not start")
}

// finished is how many access log lines serve wrote for identity's calls
// that ended with code (as the log names it: "PERMISSION_DENIED").
func (l *logs) finished(identity, code string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[identity+" "+code]
}

func (l *logs) lines(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.msgs[msg]
}

// suite is one `idemreg serve` on the embedded store, with the config file
// above, that every case attacks in turn, and the neighbour that measures
// what each attack costs the other tenant.
type suite struct {
	addr, healthAddr, metricsAddr string
	cmd                           *exec.Cmd
	logs                          *logs

	alpha, beta idemregv1.RegistryServiceClient
	alphaAdmin  idemregv1.AdminServiceClient
	betaAdmin   idemregv1.AdminServiceClient
	neighbour   *neighbour
}

func startSuite(t *testing.T) *suite {
	t.Helper()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemreg.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(configDoc), 0o600))
	s := &suite{healthAddr: servetest.FreeAddr(t), metricsAddr: servetest.FreeAddr(t), logs: newLogs()}
	p := servetest.StartWith(t, servetest.Options{Dir: dir, Observe: s.logs.observe, Args: []string{
		"--health-listen", s.healthAddr, "--metrics-listen", s.metricsAddr,
		"--data-dir", filepath.Join(dir, "data"), "--config", cfg,
		"--max-connections", strconv.Itoa(maxConnections),
		"--http-max-connections", strconv.Itoa(httpMaxConnections),
		"--http-max-connections-per-source", strconv.Itoa(httpMaxConnectionsPerSource),
		"--max-pending-calls", strconv.Itoa(maxPendingCalls),
		"--max-concurrent-streams", strconv.Itoa(maxStreams),
		"--max-header-list-size", strconv.Itoa(maxHeaderList),
		"--connection-timeout", connectionTimeout.String(),
		"--max-waiters", strconv.Itoa(maxWaiters),
		"--max-quota-consumers-per-identity", strconv.Itoa(maxQuotaConsumers),
		"--refusal-log-rate", strconv.Itoa(refusalLogRate),
		// No re-check while a flood waits: waiters wake for what this
		// replica does, as in TestWaitShareIsolatesIdentities.
		"--wait-recheck", "30s",
	}})
	s.addr, s.cmd = p.Addr, p.Cmd
	s.logs.waitServing(t, p)

	conn := servetest.Dial(t, s.addr)
	s.alpha, s.beta = idemregv1.NewRegistryServiceClient(conn), idemregv1.NewRegistryServiceClient(conn)
	s.alphaAdmin, s.betaAdmin = idemregv1.NewAdminServiceClient(conn), idemregv1.NewAdminServiceClient(conn)
	// The neighbour has a connection of its own, opened before any attack,
	// as a tenant's long-lived channel would be.
	s.neighbour = &neighbour{c: idemregv1.NewRegistryServiceClient(servetest.Dial(t, s.addr))}
	return s
}

func bearer(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

func asAlpha(ctx context.Context) context.Context { return bearer(ctx, alphaToken) }
func asBeta(ctx context.Context) context.Context  { return bearer(ctx, betaToken) }

// requireServing checks that serve still answers: its health on both
// listeners, and a Claim of each tenant.
func (s *suite) requireServing(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for _, addr := range []string{s.addr, s.healthAddr} {
		conn := servetest.Dial(t, addr)
		_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "health on %s", addr)
		_ = conn.Close()
	}
	for _, c := range []struct {
		ctx      context.Context
		consumer string
	}{{asAlpha(ctx), "alpha.alive"}, {asBeta(ctx), "beta.alive"}} {
		_, err := s.beta.Claim(c.ctx, claim(c.consumer, fmt.Sprintf("alive-%d", time.Now().UnixNano())))
		require.NoError(t, err, "%s is served", c.consumer)
	}
}

// metric sums the samples of a Prometheus metric whose labels contain
// every one of labels (`name="value"`), scraped from --metrics-listen.
func (s *suite) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	v, err := s.metricValue(name, labels...)
	require.NoError(t, err)
	return v
}

// metricNoTest is metric for the attack goroutines: -1 when the scrape
// failed.
func (s *suite) metricNoTest(name string, labels ...string) float64 {
	v, err := s.metricValue(name, labels...)
	if err != nil {
		return -1
	}
	return v
}

func (s *suite) metricValue(name string, labels ...string) (float64, error) {
	resp, err := http.Get("http://" + s.metricsAddr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return 0, err
	}
	var sum float64
	for line := range strings.SplitSeq(string(body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(line, l)
		}
		if !match {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", line, err)
		}
		sum += v
	}
	return sum, nil
}

// registry is a RegistryService client on conn.
func registry(conn *grpc.ClientConn) idemregv1.RegistryServiceClient {
	return idemregv1.NewRegistryServiceClient(conn)
}

const op = idemregv1.Kind_KIND_OPERATION

func claim(consumer, key string) *idemregv1.ClaimRequest {
	return &idemregv1.ClaimRequest{Consumer: consumer, Kind: op, Key: key}
}

func response(data string) *idemregv1.Result {
	return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "adversarial.v1.Result", Data: []byte(data)}}}
}

// requireRefused checks that err is a status with code and the registry's
// ErrorInfo with reason, and returns the status.
func requireRefused(t *testing.T, err error, code codes.Code, reason string) *status.Status {
	t.Helper()
	require.Error(t, err)
	st := status.Convert(err)
	require.Equal(t, code, st.Code(), "%v", err)
	var info *errdetails.ErrorInfo
	for _, d := range st.Details() {
		if i, ok := d.(*errdetails.ErrorInfo); ok {
			info = i
		}
	}
	require.NotNil(t, info, "no ErrorInfo in %v", err)
	require.Equal(t, reason, info.GetReason(), "%v", err)
	return st
}

// badFields is the fields a BadRequest of err names.
func badFields(err error) []string {
	var fields []string
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				fields = append(fields, v.GetField())
			}
		}
	}
	return fields
}

func claimResult(r *idemregv1.BatchClaimResult) (*idemregv1.ClaimResponse, error) {
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	return r.GetResponse(), nil
}

func completeResult(r *idemregv1.BatchCompleteResult) (*idemregv1.CompleteResponse, error) {
	if e := r.GetError(); e != nil {
		return nil, status.FromProto(e).Err()
	}
	return r.GetResponse(), nil
}
