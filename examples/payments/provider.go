package main

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	paymentsv1 "github.com/idemreg/idemreg/examples/proto/payments/v1"
)

// Provider is the example payment provider. Every Charge it executes gets a
// new charge id, so a double charge is visible, and it counts executions.
// Accounts whose name starts with "declined" are declined.
type Provider struct {
	paymentsv1.UnimplementedPaymentServiceServer

	executed atomic.Int64
	// slow, when set, delays the execution of a charge: a provider that
	// answers after the caller's deadline.
	slow func(req *paymentsv1.ChargeRequest) time.Duration
}

// Executed is how many charges the provider executed, declined ones included.
func (p *Provider) Executed() int64 { return p.executed.Load() }

// Charge implements paymentsv1.PaymentServiceServer.
func (p *Provider) Charge(ctx context.Context, req *paymentsv1.ChargeRequest) (*paymentsv1.ChargeResponse, error) {
	switch {
	case req.GetAccount() == "":
		return nil, status.Error(codes.InvalidArgument, "account is required")
	case req.GetAmountMinor() <= 0:
		return nil, status.Error(codes.InvalidArgument, "amount_minor must be positive")
	case len(req.GetCurrency()) != 3:
		return nil, status.Error(codes.InvalidArgument, "currency must be an ISO 4217 code")
	}
	n := p.executed.Add(1)
	if p.slow != nil {
		if d := p.slow(req); d > 0 {
			// The charge goes through even if the caller stopped waiting.
			time.Sleep(d)
		}
	}
	if strings.HasPrefix(req.GetAccount(), "declined") {
		st, err := status.New(codes.FailedPrecondition, "card declined").
			WithDetails(&errdetails.ErrorInfo{Domain: "payments.example", Reason: "CARD_DECLINED"})
		if err != nil {
			return nil, err
		}
		return nil, st.Err()
	}
	return &paymentsv1.ChargeResponse{
		ChargeId:    fmt.Sprintf("ch_%06d", n),
		Account:     req.GetAccount(),
		AmountMinor: req.GetAmountMinor(),
		Currency:    req.GetCurrency(),
	}, nil
}

// lossyNetwork drops the reply of every nth call after the handler ran: the
// charge happened, the caller sees UNAVAILABLE, as when a connection breaks
// on the way back. It stands in for a flaky network in the demo and tests.
type lossyNetwork struct {
	every   int64
	calls   atomic.Int64
	dropped atomic.Int64
}

func (l *lossyNetwork) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	resp, err := next(ctx, req)
	if l.every > 0 && l.calls.Add(1)%l.every == 0 {
		l.dropped.Add(1)
		return nil, status.Error(codes.Unavailable, "reply lost on the way back (simulated)")
	}
	return resp, err
}

// newProviderServer serves p with Stripe-like idempotency from the registry
// reg: a Charge must carry an idempotency key, a retried key replays the
// first answer, and a retry that arrives while the first runs gets the
// first answer when it is ready. dropEvery > 0 loses the reply of every dropEvery-th call.
func newProviderServer(p *Provider, reg *client.Client, dropEvery int64) (*grpc.Server, *lossyNetwork) {
	lossy := &lossyNetwork{every: dropEvery}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		lossy.intercept, // outermost: replies are lost after everything ran
		client.UnaryServerInterceptor(reg,
			client.WithMethods(paymentsv1.PaymentService_Charge_FullMethodName),
			client.WithMissingKey(client.MissingKeyReject),
			client.WithConsumer("payments-provider.charges"),
			// A retry arriving while the first Charge runs waits (up to its
			// own deadline) for the first one's answer instead of ABORTED.
			client.WithWaitInProgress(client.Backoff{}),
		),
	))
	paymentsv1.RegisterPaymentServiceServer(srv, p)
	return srv, lossy
}
