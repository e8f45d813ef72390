package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemreg/idemreg/client/registrytest"
	paymentsv1 "github.com/idemreg/idemreg/examples/proto/payments/v1"
)

// startProvider serves a provider on loopback, de-duplicating through its
// own registry (the provider is another company: it does not share ours).
func startProvider(t *testing.T, p *Provider, dropEvery int64) (string, *lossyNetwork) {
	t.Helper()
	reg := registrytest.Start(t)
	srv, lossy := newProviderServer(p, reg.Client, dropEvery)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String(), lossy
}

func newCharger(t *testing.T, providerAddr string, attemptTimeout time.Duration) *Charger {
	t.Helper()
	reg := registrytest.Start(t)
	conn, err := grpc.NewClient(providerAddr, grpc.WithTransportCredentials(insecure.NewCredentials()), chargeInterceptor(reg.Client))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return &Charger{API: paymentsv1.NewPaymentServiceClient(conn), Attempts: 50, AttemptTimeout: attemptTimeout}
}

type outcome struct {
	resp *paymentsv1.ChargeResponse
	err  error
	res  ChargeResult
}

// TestEveryPaymentExecutesOnce: the provider loses every second reply and
// is slow on some accounts (past the caller's deadline); each logical
// payment is retried three times by two concurrent callers. The provider
// executes every payment exactly once and every retry gets the same answer.
func TestEveryPaymentExecutesOnce(t *testing.T) {
	p := &Provider{slow: func(req *paymentsv1.ChargeRequest) time.Duration {
		if strings.HasPrefix(req.GetAccount(), "slow") {
			return 300 * time.Millisecond // the caller gives each try 100ms
		}
		return 0
	}}
	addr, lossy := startProvider(t, p, 2)
	charger := newCharger(t, addr, 100*time.Millisecond)

	type payment struct {
		op  string
		req *paymentsv1.ChargeRequest
	}
	var payments []payment
	for i := range 12 {
		account := fmt.Sprintf("acct-%d", i%4)
		switch i % 6 {
		case 4:
			account = "declined-" + account
		case 5:
			account = "slow-" + account
		}
		payments = append(payments, payment{
			op:  fmt.Sprintf("order-%d/charge-1", i),
			req: &paymentsv1.ChargeRequest{Account: account, AmountMinor: int64(100 * (i + 1)), Currency: "EUR"},
		})
	}

	const callers, retries = 2, 3
	results := make([][]outcome, len(payments))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, pay := range payments {
		for range callers {
			wg.Go(func() {
				for range retries {
					res, err := charger.Charge(t.Context(), pay.op, pay.req)
					mu.Lock()
					results[i] = append(results[i], outcome{resp: res.Response, err: err, res: res})
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()

	require.EqualValues(t, len(payments), p.Executed(), "every logical payment executed exactly once")
	require.Positive(t, lossy.dropped.Load(), "replies were lost")
	chargeIDs := map[string]string{}
	replays := 0
	for i, pay := range payments {
		first := results[i][0]
		require.Len(t, results[i], callers*retries)
		for _, o := range results[i] {
			if o.res.Replayed {
				replays++
			}
			if strings.HasPrefix(pay.req.GetAccount(), "declined") {
				require.Error(t, o.err, pay.op)
				require.Equal(t, codes.FailedPrecondition, status.Code(o.err), pay.op)
				info := status.Convert(o.err).Details()[0].(*errdetails.ErrorInfo)
				require.Equal(t, "CARD_DECLINED", info.GetReason())
				continue
			}
			require.NoError(t, o.err, pay.op)
			require.True(t, proto.Equal(first.resp, o.resp), "%s: every retry gets the same answer: %v vs %v", pay.op, first.resp, o.resp)
			require.Equal(t, pay.req.GetAmountMinor(), o.resp.GetAmountMinor())
		}
		if first.resp != nil {
			other, dup := chargeIDs[first.resp.GetChargeId()]
			require.False(t, dup, "charge id %s answers both %s and %s", first.resp.GetChargeId(), other, pay.op)
			chargeIDs[first.resp.GetChargeId()] = pay.op
		}
	}
	require.Positive(t, replays, "retries were answered from the registry")
}

func TestChargeWithoutKeyIsRefusedByTheProvider(t *testing.T) {
	addr, _ := startProvider(t, &Provider{}, 0)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	_, err = paymentsv1.NewPaymentServiceClient(conn).Charge(t.Context(), &paymentsv1.ChargeRequest{Account: "a", AmountMinor: 1, Currency: "EUR"})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
}

// TestPrograms runs the two commands as processes: a provider that loses
// every second reply, and the same payment charged twice.
func TestPrograms(t *testing.T) {
	reg := registrytest.Start(t)
	bin := filepath.Join(t.TempDir(), "payments")
	build := exec.CommandContext(t.Context(), "go", "build", "-o", bin, ".")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	provider := exec.CommandContext(ctx, bin, "provider", "-listen", "127.0.0.1:0", "-registry", reg.Addr, "-drop-every", "2")
	stdout, err := provider.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, provider.Start())
	defer func() { cancel(); _ = provider.Wait() }()
	lines := bufio.NewScanner(stdout)
	require.True(t, lines.Scan(), "the provider printed nothing")
	addr := strings.TrimPrefix(lines.Text(), "provider listening on ")
	require.NotEqual(t, lines.Text(), addr, "unexpected first line %q", lines.Text())
	go func() {
		for lines.Scan() {
		}
	}()

	charge := func(args ...string) (string, error) {
		cmd := exec.CommandContext(t.Context(), bin, append([]string{"charge", "-provider", addr, "-registry", reg.Addr, "-attempt-timeout", "5s"}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	chargeID := regexp.MustCompile(`charge_id=(\S+)`)
	first, err := charge("-op", "order-7/charge-1", "-account", "acct-7", "-amount", "1250")
	require.NoError(t, err, first)
	second, err := charge("-op", "order-7/charge-1", "-account", "acct-7", "-amount", "1250")
	require.NoError(t, err, second)
	require.Contains(t, first, "replayed=false")
	require.Contains(t, second, "replayed=true")
	require.Equal(t, chargeID.FindStringSubmatch(first)[1], chargeID.FindStringSubmatch(second)[1])

	for range 2 {
		out, err := charge("-op", "order-8/charge-1", "-account", "declined-8", "-amount", "99")
		require.Error(t, err)
		assert.Contains(t, out, "FailedPrecondition: card declined")
	}
	out2, err := charge("-op", "order-7/charge-1", "-account", "acct-7", "-amount", "9999")
	require.Error(t, err, "the same payment with another amount is refused")
	require.Contains(t, out2, "FailedPrecondition")
}
