package main

import (
	"context"
	"errors"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	paymentsv1 "github.com/idemreg/idemreg/examples/proto/payments/v1"
)

// chargeInterceptor is the whole idemreg wiring of the caller: Charge calls
// on the provider connection run once per key, under the consumer
// "checkout.charges".
func chargeInterceptor(reg *client.Client) grpc.DialOption {
	return grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(reg,
		client.WithMethods(paymentsv1.PaymentService_Charge_FullMethodName),
		client.WithConsumer("checkout.charges"),
	))
}

// Charger charges through a provider connection that has chargeInterceptor,
// retrying what may succeed on a retry.
type Charger struct {
	API paymentsv1.PaymentServiceClient
	// Attempts bounds the tries of one Charge; AttemptTimeout bounds each.
	Attempts       int
	AttemptTimeout time.Duration
}

// ChargeResult is the answer to one logical payment.
type ChargeResult struct {
	Response *paymentsv1.ChargeResponse
	// Replayed: the answer came from the registry, not from a new charge.
	Replayed bool
	// Attempts is how many calls it took.
	Attempts int
}

// Charge makes the payment opID. Every call with the same opID, from this
// process or another, retried now or tomorrow within the retention, gets the
// answer of the one charge the provider executed.
func (c *Charger) Charge(ctx context.Context, opID string, req *paymentsv1.ChargeRequest) (ChargeResult, error) {
	// The key names the logical operation, created once by the caller and
	// reused on every retry; not the order, not the customer.
	ctx = client.WithIdempotencyKey(ctx, "payment:"+opID)
	delay := 20 * time.Millisecond
	var res ChargeResult
	for {
		res.Attempts++
		actx, cancel := context.WithTimeout(ctx, c.AttemptTimeout)
		resp, err := c.API.Charge(actx, req, client.Replayed(&res.Replayed))
		cancel()
		if err == nil {
			res.Response = resp
			return res, nil
		}
		if !retryable(err) || res.Attempts >= c.Attempts || ctx.Err() != nil {
			return res, err
		}
		wait := max(delay, retryDelay(err))
		select {
		case <-ctx.Done():
			return res, err
		case <-time.After(wait):
		}
		delay = min(2*delay, time.Second)
	}
}

// retryable: the call may not have happened, or it is still running
// (ABORTED with RetryInfo from either idempotency interceptor).
func retryable(err error) bool {
	var ue *client.UnavailableError
	if errors.As(err, &ue) {
		return true // the registry is down: nothing was charged
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted, codes.ResourceExhausted:
		return true
	}
	return false
}

func retryDelay(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			// Poll sooner than the whole lease: the charge usually ends first.
			return min(r.GetRetryDelay().AsDuration(), 200*time.Millisecond)
		}
	}
	return 0
}
