package registrytest_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/registrytest"
)

// A message consumer runs its handler through Once: the first delivery of a
// message id runs it, every redelivery gets the stored outcome.
func Example_once() {
	reg, err := registrytest.New() // in production: client.New(conn to the registry)
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()
	c := reg.Client

	handle := func(ctx context.Context, messageID string, amount int64) error {
		res, err := c.Once(ctx, "ledger.payments", messageID, func(ctx context.Context, a client.Attempt) ([]byte, error) {
			if amount <= 0 {
				return nil, client.Final(errors.New("amount must be positive")) // stored, replayed, never retried
			}
			// Apply the payment with a write fenced by a.Token here.
			return nil, nil
		})
		switch {
		case err == nil:
			fmt.Printf("%s: ack (ran=%v, replayed=%v)\n", messageID, res.Ran, res.Replayed)
		case client.IsFinal(err):
			fmt.Printf("%s: ack, refused for good: %v (replayed=%v)\n", messageID, err, res.Replayed)
		default:
			var busy *client.InProgressError
			if errors.As(err, &busy) {
				fmt.Printf("%s: redeliver after %v\n", messageID, busy.RetryAfter)
			} else {
				fmt.Printf("%s: redeliver: %v\n", messageID, err)
			}
		}
		return nil
	}

	ctx := context.Background()
	_ = handle(ctx, "pay-1", 1250)
	_ = handle(ctx, "pay-1", 1250) // the broker redelivers
	_ = handle(ctx, "pay-2", 0)
	_ = handle(ctx, "pay-2", 0)
	// Output:
	// pay-1: ack (ran=true, replayed=false)
	// pay-1: ack (ran=false, replayed=true)
	// pay-2: ack, refused for good: amount must be positive (replayed=false)
	// pay-2: ack, refused for good: amount must be positive (replayed=true)
}

// A consumer that fetches messages in batches handles each batch with
// OnceBatch: one BatchClaim, the handler for each message acquired, one
// BatchComplete, and one result per message saying whether to acknowledge.
//
// Its options are BatchOptions: WithLease (a SharedOption) and WithKind (a
// MessageOption) compile here; WithMessageFingerprint (a OnceOption: each
// BatchMessage carries its own) and WithMethods (an InterceptorOption) do
// not.
func Example_onceBatch() {
	reg, err := registrytest.New()
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()
	c := reg.Client

	amounts := []int64{1250, 0, 1250}
	batch := []client.BatchMessage{{ID: "pay-1"}, {ID: "pay-2"}, {ID: "pay-1"}} // pay-1 delivered twice
	results := c.OnceBatch(context.Background(), "ledger.payments", batch, func(ctx context.Context, i int, a client.Attempt) ([]byte, error) {
		if amounts[i] <= 0 {
			return nil, client.Final(errors.New("amount must be positive"))
		}
		// Apply the payment with a write fenced by a.Token here.
		return nil, nil
	}, client.WithLease(10*time.Second))
	for i, r := range results {
		ack := r.Err == nil || client.IsFinal(r.Err)
		fmt.Printf("%s: ack=%v ran=%v replayed=%v duplicate=%v\n", batch[i].ID, ack, r.Ran, r.Replayed, r.Duplicate)
	}
	// Output:
	// pay-1: ack=true ran=true replayed=false duplicate=false
	// pay-2: ack=true ran=true replayed=false duplicate=false
	// pay-1: ack=true ran=false replayed=true duplicate=true
}
